"""Typed tasks: ``@ax.task`` turns a function into a :class:`Task`, typed by its signature
(docs/typed_tasks.md shows every use)::

    @ax.task("order.close", priority="high", max_retry=3, timeout="30s")
    def close(order: int, *, ctx: ax.Context) -> None: ...

    close.enqueue(42, delay=1800, biz_key="o-42")          # -> ax.TaskId
    close.enqueue_many([close.item(1), close.options(delay=60).item(2)])
    close.schedule("close.sweep", 0, cron="*/5 * * * *")   # -> ax.JobView
    await close.aenqueue(42, delay=5)                      # through ax_kombu.aio

- **Binding.** A call's arguments are bound to the signature without its ``ctx`` parameter
  (named ``ctx``, positional or keyword-only: the worker gives the run's
  :class:`~ax_kombu.core.context.Context` there) at once: a missing or unexpected argument
  is a :class:`~ax_kombu.exceptions.ValidationError`, and nothing is written.
- **Payload.** The bound arguments, defaults applied, by parameter name (``{"order": 42}``;
  ``*args`` a list, ``**kwargs`` an object, under their own names).
- **Options.** :data:`ENQUEUE_OPTIONS` and :data:`SCHEDULE_OPTIONS` are keyword arguments of
  the methods, never the function's: a parameter named like one is refused at decoration.
- **Running.** The worker calls ``fn(**payload, ctx=ctx)`` (positional-only parameters
  positionally); a payload that does not fit the signature fails its run at once with
  :class:`~ax_kombu.exceptions.Discard` (no retry).
- **Registration.** In a process that has loaded the worker (``ax-worker -A module`` loads
  it first), at decoration; a producer importing the module loads no worker code.
- **Typing.** ``Task[P, R]`` is generic in the function's ``ParamSpec``. PEP 612 allows no
  options beside ``P.kwargs`` and cannot drop ``ctx`` from ``P``: the mypy plugin
  :mod:`ax_kombu.mypy_plugin` does both at each call.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from ax_kombu.core.backoff import Backoff
from ax_kombu.core.context import Context
from ax_kombu.exceptions import Discard, ValidationError
from ax_kombu.task_options import (
    ENQUEUE_OPTIONS,
    SCHEDULE_OPTIONS,
    VARIADIC,
    Options,
    check_defaults,
    parse_timeout,
    signatures,
)
from ax_kombu.views import TaskId

if TYPE_CHECKING:
    from ax_kombu.api import Client
    from ax_kombu.recurring import JobView

__all__ = ["ENQUEUE_OPTIONS", "SCHEDULE_OPTIONS", "Options", "Task", "TaskCall", "install",
           "parse_timeout", "task", "tasks"]

P = ParamSpec("P")
R = TypeVar("R")

_tasks: dict[str, Task[Any, Any]] = {}


class Task(Options, Generic[P, R]):
    """A function registered as the processor of ``task_type``, with typed ways to enqueue
    it (made by :func:`ax_kombu.task`; calling it calls the function)."""

    def __init__(self, fn: Callable[P, R], task_type: str, *, defaults: Mapping[str, Any],
                 retry_on: tuple[type[BaseException], ...] | None, backoff: Backoff | None,
                 client: Callable[[], Client]) -> None:
        self.fn = fn
        self.task_type = task_type
        #: the options every enqueue starts from (priority, max_retry, timeout_ms)
        self.defaults = dict(defaults)
        self.retry_on = retry_on
        self.backoff = backoff
        self._client = client
        self._bare, self._takes_ctx = signatures(task_type, fn)
        #: the signature's parameters in messages, without annotations: ``close(order)``
        self.shown = self.fn.__qualname__ + str(self._bare.replace(
            parameters=[p.replace(annotation=p.empty) for p in self._bare.parameters.values()],
            return_annotation=inspect.Signature.empty))
        self.registered = False
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"<ax.Task {self.task_type!r} {self.shown}>"

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(*args, **kwargs)

    def payload(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The JSON payload object a call's arguments make (no options among them).

        Raises:
            ValidationError: the arguments do not fit the signature.
        """
        try:
            bound = self._bare.bind(*args, **kwargs)
        except TypeError as exc:
            raise ValidationError(f"task {self.task_type!r}: {exc} "
                                  f"(signature {self.shown})") from None
        bound.apply_defaults()
        return {name: list(value) if isinstance(value, tuple) else value
                for name, value in bound.arguments.items()}

    def _split(self, kwargs: dict[str, Any], names: frozenset[str],
               options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The defaults, then ``options``, then the option names taken out of ``kwargs``
        (a default left None is left out: the client's own applies)."""
        chosen = {**self.defaults, **(options or {})}
        chosen.update({name: kwargs.pop(name) for name in names & set(kwargs)})
        return {k: v for k, v in chosen.items() if v is not None or k not in self.defaults}

    def item(self, *args: P.args, **kwargs: P.kwargs) -> dict[str, Any]:
        """One item for :meth:`enqueue_many` (or :func:`ax_kombu.enqueue_many`): the
        options given among ``kwargs``, the payload bound from the rest.

        Raises:
            ValidationError: the arguments do not fit the signature.
        """
        return self._item(args, dict(kwargs), {})

    def _item(self, args: tuple[Any, ...], kwargs: dict[str, Any],
              options: Mapping[str, Any]) -> dict[str, Any]:
        chosen = self._split(kwargs, ENQUEUE_OPTIONS, options)
        return {"task_type": self.task_type, "payload": self.payload(*args, **kwargs), **chosen}

    def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> TaskId:
        """Schedule one run with these arguments; :data:`ENQUEUE_OPTIONS` given among the
        keywords are :func:`ax_kombu.enqueue`'s (``delay=``/``run_at=``, ``biz_key=``,
        ``connection=``…).

        Returns:
            The task id (as :func:`ax_kombu.enqueue`).
        Raises:
            ValidationError: the arguments do not fit the signature, or a bad option or
                value; nothing was written.
        """
        return self._enqueue(args, dict(kwargs), {})

    def _enqueue(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 options: Mapping[str, Any]) -> TaskId:
        item = self._item(args, kwargs, options)
        return self._client().enqueue(item.pop("task_type"), item.pop("payload"), **item)

    async def aenqueue(self, *args: P.args, **kwargs: P.kwargs) -> TaskId:
        """:meth:`enqueue` through :func:`ax_kombu.aio.enqueue`: it never blocks the event
        loop (``connection=`` takes an async SQLAlchemy connection or session).

        Raises:
            ValidationError: as :meth:`enqueue`.
        """
        return await self._aenqueue(args, dict(kwargs), {})

    async def _aenqueue(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                        options: Mapping[str, Any]) -> TaskId:
        from ax_kombu import aio  # SQLAlchemy's asyncio only for a producer that uses it

        item = self._item(args, kwargs, options)
        return await aio.enqueue(item.pop("task_type"), item.pop("payload"), **item)

    def enqueue_many(self, items: Iterable[Mapping[str, Any]], *,
                     connection: Any = None) -> list[TaskId]:
        """Schedule many runs in one transaction; each item made by :meth:`item` (or
        ``.options(…).item(…)``) of this task.

        Raises:
            ValidationError: an item of another task type or not an item, or any item
                invalid (the message names it); nothing was written.
        """
        return self._client().enqueue_many(self._own(items), connection=connection)

    async def aenqueue_many(self, items: Iterable[Mapping[str, Any]], *,
                            connection: Any = None) -> list[TaskId]:
        """:meth:`enqueue_many` through :func:`ax_kombu.aio.enqueue_many`.

        Raises:
            ValidationError: as :meth:`enqueue_many`.
        """
        from ax_kombu import aio

        return await aio.enqueue_many(self._own(items), connection=connection)

    def _own(self, items: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """``items``, each checked to be an item of this task (``ValidationError``)."""
        checked = list(items)
        for index, entry in enumerate(checked):
            if not isinstance(entry, Mapping) or entry.get("task_type") != self.task_type:
                raise ValidationError(f"item {index}: not an item of task {self.task_type!r} "
                                      f"(make it with {self.fn.__qualname__}.item(...))")
        return checked

    def schedule(self, job_name: str, /, *args: P.args, **kwargs: P.kwargs) -> JobView:
        """Create or update the recurring job ``job_name`` (:func:`ax_kombu.schedule`) whose
        every occurrence runs this task with these arguments; :data:`SCHEDULE_OPTIONS`
        (``cron=`` or ``every=``, ``tz=``, ``misfire=``, ``strategy=``…) are given among the
        keywords.

        Raises:
            ValidationError: the arguments do not fit the signature, or a bad schedule;
                nothing was written.
        """
        rest = dict(kwargs)
        chosen = self._split(rest, SCHEDULE_OPTIONS)
        payload = self.payload(*args, **rest)
        return self._client().schedule(job_name, self.task_type, payload, **chosen)

    def options(self, **options: Any) -> TaskCall[P, R]:
        """These :data:`ENQUEUE_OPTIONS` bound for a later ``.enqueue(…)``, ``.aenqueue(…)``
        or ``.item(…)`` whose own arguments are then only the function's.

        Raises:
            ValidationError: a name that is not an enqueue option.
        """
        unknown = sorted(set(options) - ENQUEUE_OPTIONS)
        if unknown:
            raise ValidationError(f"task {self.task_type!r}: unknown option(s) "
                                  f"{', '.join(unknown)}; options are "
                                  f"{', '.join(sorted(ENQUEUE_OPTIONS))}")
        return TaskCall(self, options)

    def run(self, payload: Any, ctx: Context) -> Any:
        """Run the function on a stored payload (what the worker's processor does).

        Raises:
            Discard: the payload does not fit the signature (no retry).
        """
        args, kwargs = self.arguments(payload, ctx)
        fn: Callable[..., R] = self.fn
        return fn(*args, **kwargs)

    def arguments(self, payload: Any, ctx: Context) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional and keyword arguments a stored payload gives the function.

        Raises:
            Discard: not an object, or its keys do not fit the signature.
        """
        params = self._bare.parameters
        if not isinstance(payload, dict):
            raise Discard(f"task {self.task_type!r}: the payload is {type(payload).__name__}, "
                          f"not the object of {self.fn.__qualname__}'s arguments")
        missing = [n for n, p in params.items()
                   if n not in payload and p.default is p.empty and p.kind not in VARIADIC]
        unexpected = sorted(set(payload) - set(params))
        if missing or unexpected:
            raise Discard(f"task {self.task_type!r}: the payload does not fit "
                          f"{self.shown} (missing: "
                          f"{', '.join(missing) or '-'}; unexpected: "
                          f"{', '.join(unexpected) or '-'})")
        arguments = {name: ctx if name == "ctx" else payload.get(name, param.default)
                     for name, param in inspect.signature(self.fn).parameters.items()
                     if name == "ctx" or name in payload or param.kind not in VARIADIC}
        bound = inspect.BoundArguments(inspect.signature(self.fn), arguments)
        return bound.args, bound.kwargs

    def processor(self) -> Callable[[Any, Context], Any]:
        """The ``(payload, ctx)`` callable registered for the worker: an ``async def`` for an
        ``async def`` function."""
        if inspect.iscoroutinefunction(self.fn):
            async def run_async(payload: Any, ctx: Context) -> Any:
                args, kwargs = self.arguments(payload, ctx)
                fn: Callable[..., Any] = self.fn
                return await fn(*args, **kwargs)

            return run_async
        return self.run

    def register(self) -> None:
        """Register :meth:`processor` as the worker's processor of the task type (this loads
        the worker's code).

        Raises:
            ValidationError: the worker refuses it (as :func:`ax_kombu.processor`).
        """
        from ax_kombu.worker import processors

        processors.processor(self.task_type, retry_on=self.retry_on,
                             backoff=self.backoff)(self.processor())
        self.registered = True


class TaskCall(Options, Generic[P, R]):
    """A :class:`Task` with enqueue options bound (``task.options(delay=60)``)."""

    def __init__(self, task: Task[P, R], options: Mapping[str, Any]) -> None:
        self.task = task
        self.options = dict(options)

    def __repr__(self) -> str:
        return f"<ax.TaskCall {self.task.task_type!r} {self.options!r}>"

    def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> TaskId:
        """:meth:`Task.enqueue` with the bound options (options given here win)."""
        return self.task._enqueue(args, dict(kwargs), self.options)

    async def aenqueue(self, *args: P.args, **kwargs: P.kwargs) -> TaskId:
        """:meth:`Task.aenqueue` with the bound options (options given here win)."""
        return await self.task._aenqueue(args, dict(kwargs), self.options)

    def item(self, *args: P.args, **kwargs: P.kwargs) -> dict[str, Any]:
        """:meth:`Task.item` with the bound options (options given here win)."""
        return self.task._item(args, dict(kwargs), self.options)


def task(task_type: str, *, client: Callable[[], Client], priority: str = "default",
         max_retry: int | None = None, timeout: float | timedelta | str | None = None,
         retry_on: tuple[type[BaseException], ...] | None = None,
         backoff: Backoff | None = None) -> Callable[[Callable[P, R]], Task[P, R]]:
    """The decorator behind :func:`ax_kombu.task` (``client``: the producer client getter).

    Raises:
        ValidationError: a bad argument, or (at decoration) a function whose parameters
            clash with the options; nothing is registered.
    """
    check_defaults(task_type, priority, max_retry, retry_on, backoff)
    defaults = {"priority": priority, "max_retry": max_retry,
                "timeout_ms": parse_timeout(timeout)}

    def decorate(fn: Callable[P, R]) -> Task[P, R]:
        made = Task(fn, task_type, defaults=defaults, retry_on=retry_on, backoff=backoff,
                    client=client)
        if "ax_kombu.worker.processors" in sys.modules:  # a worker importing its -A modules
            made.register()
        _tasks[task_type] = made
        return made

    return decorate


def tasks() -> dict[str, Task[Any, Any]]:
    """Every typed task declared in this process so far: task type → task."""
    return dict(_tasks)


def install() -> list[str]:
    """Register every typed task not registered yet with the worker (for a worker built in
    a process that imported its task modules first); returns their task types."""
    done = [made for made in _tasks.values() if not made.registered]
    for made in done:
        made.register()
    return [made.task_type for made in done]
