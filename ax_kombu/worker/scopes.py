"""Run scopes: what wraps every started run, on its thread or in its coroutine.

A scope is entered just before a run's processor is called and left when it returns or
raises, in the same thread (a sync processor) or the same asyncio task (an ``async def``
one), so it may set context variables (the current span, the run's log buffer) that the
processor's own code sees. A scope must not raise: an exception it raises, on entry or on
exit, is the run's outcome like one the processor raised (nothing catches it apart). The
worker builds its scopes once (:func:`run_scopes`); :class:`~ax_kombu.worker.
starts.Starter` enters them in order and leaves them in reverse.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

from ax_kombu.config import Settings
from ax_kombu.core.context import Context
from ax_kombu.observability import tracing
from ax_kombu.worker.runlog import run_log_scope
from ax_kombu.worker.task import RunTask

#: what a run without scopes is wrapped in (a nullcontext may be entered again and again)
_NO_SCOPE = nullcontext()

#: one scope: given the run's task and context, a context manager around its processor
RunScope = Callable[[RunTask, Context], AbstractContextManager[Any]]


def run_scopes(settings: Settings) -> list[RunScope]:
    """The scopes every run of a worker with ``settings`` is wrapped in, outermost first."""
    return [*tracing.run_scopes(settings.queue_for), *run_log_scope(settings)]


def entered(scopes: Sequence[RunScope], task: RunTask,
            ctx: Context) -> AbstractContextManager[Any]:
    """``scopes`` for one run, as one context manager to use with ``with`` (entered in
    order, left in reverse). A worker has one scope or none unless it traces: those cases
    make no :class:`ExitStack`, which is a measurable share of a short run's cost."""
    if len(scopes) == 1:
        return scopes[0](task, ctx)
    if not scopes:
        return _NO_SCOPE
    stack = ExitStack()
    try:
        for scope in scopes:
            stack.enter_context(scope(task, ctx))
    except BaseException:
        stack.close()
        raise
    return stack
