"""What runs a task: registered callables, allow-listed dotted paths, HTTP callbacks.

A task names its processor in one of three ways, resolved in this order:

1. **A registered name** — ``@ax.processor("coupon.grant")`` in a module the
   worker imported (``ax-worker -A app.tasks``). The default name is the
   task type.
2. **A dotted path** ``package.module:function``. A message is untrusted
   input, so the path is resolved *only* inside the modules the worker was
   told to load (``-A`` or ``AX_PROCESSOR_MODULES``), by looking the module
   up among those already imported — never by importing anything — and the
   function must be defined in that module (a name it merely imported, such
   as ``subprocess.run``, is refused). ``os:system`` or ``subprocess:run``
   are refused with :class:`~ax_kombu.exceptions.ProcessorRefused`; nothing
   is imported or called.
3. **A callback_url**: an HTTP POST of ``{"payload", "task_id", "attempt",
   "trace_id"}`` as JSON, with an ``X-Trace-Id`` header (and a signature with
   ``AX_CALLBACK_SECRET``). A 2xx answer is success; any other status, a
   redirect (never followed), an error or no complete answer within the task's
   ``timeout_ms`` is a failure. Internal addresses are refused unless their
   host is listed in ``AX_CALLBACK_ALLOW_HOSTS``; see
   :mod:`ax_kombu.worker.callbacks`.

Every processor is called as ``func(payload, ctx)`` with a :class:`Context`; an ``async def``
one is awaited on the worker's event loop (:mod:`ax_kombu.worker.eventloop`).

**What a failure means** is the processor's to say: it may raise ``ax.Retry(delay=…)``
(a retry, after that delay), ``ax.Snooze(s)`` (run again later, no retry counted) or
``ax.Discard(reason)`` (fail now), and a registration may carry a
:class:`~ax_kombu.core.backoff.RetryPolicy` (``retry_on``: the only exceptions retried;
``backoff``: its own back-off). The result
writer looks the policy up by the task's processor name (:func:`policy_of`) and
:func:`~ax_kombu.worker.outcomes.decide` applies it.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from ax_kombu.core.backoff import Backoff, RetryPolicy
from ax_kombu.core.context import Cancellation, Context
from ax_kombu.exceptions import (
    ConfigurationError,
    ProcessorNotFound,
    ProcessorRefused,
    ValidationError,
)
from ax_kombu.worker.callback_targets import check_callback_url, host_allowed
from ax_kombu.worker.callbacks import callback_processor, post_callback

__all__ = ["Cancellation", "Context", "Resolver", "RetryPolicy", "check_callback_url",
           "host_allowed", "is_async", "load_modules", "policy_of", "post_callback", "processor",
           "registered", "split_names"]

F = TypeVar("F", bound=Callable[..., Any])
Processor = Callable[[Any, "Context"], Any]

_registry: dict[str, Callable[..., Any]] = {}
_policies: dict[str, RetryPolicy] = {}


def processor(task_type: str, *, retry_on: tuple[type[BaseException], ...] | None = None,
              backoff: Backoff | None = None) -> Callable[[F], F]:
    """Register the decorated callable as the processor of ``task_type``.

    Example::

        @ax.processor("sms.send", retry_on=(TimeoutError,),
                      backoff=ax.Backoff(base=1, cap=600, jitter=0.5))
        def send(payload, ctx): ...

    Args:
        retry_on: the exception classes whose runs are retried; any other exception
            fails its task at once (None: every exception is retried). ``ax.Retry``,
            ``ax.Snooze`` and ``ax.Discard`` mean what they say whatever this holds, and
            timeouts are retried.
        backoff: this type's back-off, instead of the worker's ``AX_RETRY_BACKOFF_*``.
    Raises:
        ValidationError: ``task_type`` is empty, ``retry_on`` is not a tuple of exception
            classes, ``backoff`` is not an ``ax.Backoff``, or the callable is an async
            generator function (nothing to await). Nothing is registered.

    An ``async def`` processor is awaited on the worker's event loop (one per worker
    process), in the same lane slots, with the same timeouts and outcomes as a plain
    one; a timeout or ``ax cancel`` cancels it.
    """
    if not task_type or not isinstance(task_type, str):
        raise ValidationError("processor() needs a non-empty task type")
    policy = _policy(task_type, retry_on, backoff)

    def register(func: F) -> F:
        if is_async_generator(func):
            raise ValidationError(
                f"processor {task_type!r}: {_name(func)} is an async generator; a processor "
                "is a plain function or an async def that returns its result")
        _registry[task_type] = func
        if policy is None:
            _policies.pop(task_type, None)
        else:
            _policies[task_type] = policy
        return func

    return register


def _policy(task_type: str, retry_on: Any, backoff: Any) -> RetryPolicy | None:
    """``processor()``'s policy arguments, checked (None: neither given)."""
    if retry_on is not None and not (
            isinstance(retry_on, tuple) and all(
                isinstance(c, type) and issubclass(c, BaseException) for c in retry_on)):
        raise ValidationError(f"processor {task_type!r}: retry_on must be a tuple of "
                              f"exception classes, got {retry_on!r}")
    if backoff is not None and not isinstance(backoff, Backoff):
        raise ValidationError(f"processor {task_type!r}: backoff must be an ax.Backoff, got "
                              f"{type(backoff).__name__}")
    if retry_on is None and backoff is None:
        return None
    return RetryPolicy(retry_on, backoff)


def policy_of(name: str | None) -> RetryPolicy | None:
    """The policy registered with the processor ``name`` (None: none, or not registered)."""
    return _policies.get(name) if name else None


def is_async(func: Any) -> bool:
    """True for an ``async def`` (or async generator) function, a partial of one, or an
    object whose ``__call__`` is one: the worker awaits what it returns on its event loop."""
    call = getattr(func, "__call__", None)  # noqa: B004 - an instance's async __call__
    return any(inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f)
               for f in (func, call) if f is not None)


def is_async_generator(func: Any) -> bool:
    """True for an async generator function (or a partial of one, or an object whose
    ``__call__`` is one): it returns nothing a worker could await."""
    call = getattr(func, "__call__", None)  # noqa: B004 - an instance's async __call__
    return any(inspect.isasyncgenfunction(f) for f in (func, call) if f is not None)


def _name(func: Any) -> str:
    return str(getattr(func, "__qualname__", None) or type(func).__name__)


def call(func: Callable[..., Any], payload: Any, ctx: Context) -> Any:
    """Run a plain ``func(payload, ctx)`` and return its value (an ``async def`` one is
    awaited with :func:`call_async` instead).

    Raises:
        ProcessorRefused: it returned an awaitable (a coroutine or a future) although it
            is not an ``async def``: its body was not run here, so the run fails (no
            retry) rather than count as a success. A coroutine is closed, so nothing
            later runs it half-way.
    """
    value = func(payload, ctx)
    if inspect.isawaitable(value):
        _close(value)
        raise ProcessorRefused(
            f"processor {_name(func)} returned {type(value).__name__}, an awaitable, but is "
            "not an async def: its body did not run (ax awaits only processors declared "
            "async def); declare it async def")
    return value


def call_async(func: Callable[..., Any], payload: Any, ctx: Context) -> Awaitable[Any]:
    """Call an ``async def`` ``func(payload, ctx)``: what to await for its value (its body
    runs when it is awaited; a plain function, not one more coroutine per run).

    Raises:
        ProcessorRefused: it returned something that cannot be awaited (an async
            generator, say): nothing ran.
    """
    value = func(payload, ctx)
    if not inspect.isawaitable(value):
        _close(value)
        raise ProcessorRefused(f"processor {_name(func)} returned {type(value).__name__}, "
                               "which cannot be awaited: nothing ran")
    return value


def _close(value: Any) -> None:
    """Close a coroutine that will not run, so nothing later runs it half-way."""
    close = getattr(value, "close", None)
    if callable(close):
        close()


def registered(task_type: str) -> Callable[..., Any] | None:
    """The processor registered for ``task_type``, if any."""
    return _registry.get(task_type)


def split_names(text: str | Iterable[str]) -> list[str]:
    """``"a, b,,c"`` (or an iterable of such strings) as ``["a", "b", "c"]``."""
    parts = [text] if isinstance(text, str) else list(text)
    return [n.strip() for part in parts for n in part.split(",") if n.strip()]


def load_modules(names: Iterable[str]) -> list[str]:
    """Import the modules that register processors; returns their names.

    Raises:
        ConfigurationError: a module cannot be imported (the message says why).
    """
    loaded = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import failure is a bad -A
            raise ConfigurationError(f"cannot import processor module {name!r}: "
                                     f"{type(exc).__name__}: {exc}") from None
        loaded.append(name)
    return loaded


class Resolver:
    """Maps a task's processor name or callback_url to the callable that runs it.

    Args:
        modules: the only modules a dotted path may point into.
        allow_hosts: callback hosts allowed (``host`` or ``*.domain``), internal ones
            included; empty: any host whose addresses are all public.
        callback_secret: signs every callback request when not empty.
        callback_signing: how: ``standard`` or ``legacy`` (:mod:`ax_kombu.worker.callbacks`).
    """

    def __init__(self, modules: Iterable[str] = (), allow_hosts: Iterable[str] = (),
                 callback_secret: str = "", callback_signing: str = "standard") -> None:
        self.modules = frozenset(modules)
        self.allow_hosts = tuple(h.strip().lower() for h in allow_hosts if h.strip())
        self._callback_secret = callback_secret
        self._callback_signing = callback_signing

    def __repr__(self) -> str:
        return (f"Resolver(modules={sorted(self.modules)!r}, allow_hosts={self.allow_hosts!r}, "
                f"signed={bool(self._callback_secret)})")

    def resolve(self, name: str | None, callback_url: str | None = None) -> Processor:
        """The callable for a task.

        Raises:
            ProcessorNotFound: nothing of that name is known here.
            ProcessorRefused: the name or callback host is not allowed.
        """
        if callback_url is not None:
            check_callback_url(callback_url, self.allow_hosts)
            return callback_processor(callback_url, self.allow_hosts, self._callback_secret,
                                      self._callback_signing)
        if not name:
            raise ProcessorNotFound("the task names no processor and no callback_url")
        func = registered(name)
        if func is not None:
            return func
        if ":" in name:
            return self._dotted(name)
        raise ProcessorNotFound(f"no processor {name!r} is registered on this worker "
                                "(load the module that registers it with -A)")

    def _dotted(self, name: str) -> Processor:
        module_name, _, attr = name.partition(":")
        if module_name not in self.modules:
            raise ProcessorRefused(f"processor {name!r} refused: {module_name!r} is not a "
                                   "module this worker was told to load (-A)")
        if not attr.isidentifier() or attr.startswith("_"):
            raise ProcessorRefused(f"processor {name!r} refused: {attr!r} is not a public "
                                   "function name")
        module = sys.modules.get(module_name)
        func = getattr(module, attr, None) if module is not None else None
        if func is None:
            raise ProcessorNotFound(f"processor {name!r}: {module_name} has no {attr!r}")
        if not callable(func) or getattr(func, "__module__", None) != module_name:
            raise ProcessorRefused(f"processor {name!r} refused: not a function defined in "
                                   f"{module_name}")
        if is_async_generator(func):
            raise ProcessorRefused(f"processor {name!r} refused: an async generator")
        result: Processor = func
        return result
