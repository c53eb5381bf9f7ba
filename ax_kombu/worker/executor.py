"""The executor seam: what the intake hands fenced runs to, and what it gets back.

An executor runs jobs and reports each one's :class:`~ax_kombu.core.outcomes.Outcome`
exactly once to the job's ``done``: with its result, a timeout, or "abandoned". The
intake (:mod:`ax_kombu.worker.starts`) names only :class:`Executor`; the bounded thread
pool (:class:`ax_kombu.worker.pools.Pool`) is one implementation, and another (an asyncio
loop, say) can stand beside it without a change to the intake, as long as it keeps the
contract below.

A job's function may return a :class:`Deferred` instead of a value: its run goes on
elsewhere (an ``async def`` processor on the worker's event loop,
:mod:`ax_kombu.worker.eventloop`), and the executor keeps the job's slot until the run
reports its end. Slots, timeouts, abandon and the single report stay the executor's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from ax_kombu.core.outcomes import Outcome

Done = Callable[[Outcome], None]


#: how a deferred run reports its end, once, from any thread: its value, or what it raised
Ended = Callable[[Any, BaseException | None], None]


class Deferred:
    """What a job's function returns when its run goes on after it returned (a deferred
    run): the executor calls :attr:`launch` with the :data:`Ended` callback that reports
    the run's outcome, and keeps the job's slot until then.

    Args:
        launch: hands the run on (it must not block); raising means the run ended so.
    """

    __slots__ = ("launch",)

    def __init__(self, launch: Callable[[Ended], None]) -> None:
        self.launch = launch


class Cancellable(Protocol):
    """A job's cancellation signal, as the executor sets it (reason ``"timeout"``,
    ``"shutdown"``)."""

    def set(self, reason: str) -> None: ...


#: a job's timeout in seconds, or a function giving it when the job is taken to run
Timeout = float | Callable[[], float] | None


class Submission(NamedTuple):
    """One job: what to call, whom to tell, and when it may start."""

    fn: Callable[[], Any]
    done: Done
    timeout_s: Timeout
    labels: Mapping[str, Any]
    cancel: Cancellable | None
    #: not taken to run before this (the executor's monotonic clock; 0: at once)
    start_at: float
    #: taken by the executor's feed (its event loop: the job only starts a deferred run,
    #: and must not block), not by one of its threads; see :meth:`Executor.attach_feed`
    on_loop: bool = False


class Feedable(Protocol):
    """What a feed (:meth:`ax_kombu.worker.eventloop.EventLoop.feed`) takes ``on_loop`` jobs
    from: an :class:`Executor` seen from the feed's thread."""

    def take_loop(self) -> tuple[list[Any], float | None]:
        """The ``on_loop`` jobs that may start now (their slots taken), and when the next
        waiting one may (the executor's clock; None: none waits, or no slot is free: the
        executor pokes the feed when that changes)."""
        ...

    def launch(self, job: Any) -> None:
        """Call a job taken by :meth:`take_loop` (the feed's thread; it must not block)."""
        ...

    def clock(self) -> float: ...


class Executor(Feedable, Protocol):
    """Runs submitted jobs; the contract the intake relies on:

    * :meth:`submit_reserved` takes every job (its room was counted before) or, once the
      executor is closed, none (False);
    * a job waiting for its ``start_at`` takes no worker of the executor's, and is taken
      in ``start_at`` order;
    * each job's ``done`` is called exactly once, and only after ``fn`` returned or raised,
      or without calling ``fn`` if the job was abandoned first;
    * after :meth:`release_cancelled`, waiting jobs whose signal is set are taken now;
    * a job submitted ``on_loop`` is taken by the feed attached with :meth:`attach_feed`
      (by a thread of the executor's if none is), under the same slots, and its function
      is called on the feed's thread.
    """

    def submit_reserved(self, jobs: Sequence[Submission]) -> bool: ...

    def release_cancelled(self) -> None: ...

    def attach_feed(self, poke: Callable[[], None]) -> None: ...
