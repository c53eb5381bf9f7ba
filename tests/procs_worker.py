"""Processors the worker tests run (registered on import; also loaded with ``-A``)."""

from __future__ import annotations

import threading
import time
from subprocess import run  # noqa: F401 - imported, not defined here: must be refused
from typing import Any

import ax_kombu as ax
from ax_kombu.worker.processors import Context

#: task_id → how many times a processor ran it (in this process)
calls: dict[int, int] = {}
#: task_id → the context a processor was given
contexts: dict[int, Context] = {}
#: task_id → the wall clock (epoch ms) when a processor started it
started_ms: dict[int, float] = {}
#: released by tests to let hanging processors return
release = threading.Event()
_lock = threading.Lock()


def _count(ctx: Context) -> None:
    now_ms = time.time() * 1000.0
    with _lock:
        started_ms[ctx.task_id] = now_ms
        calls[ctx.task_id] = calls.get(ctx.task_id, 0) + 1
        contexts[ctx.task_id] = ctx


@ax.processor("t.noop")
def noop(payload: Any, ctx: Context) -> None:
    _count(ctx)


@ax.processor("t.flaky")
def flaky(payload: Any, ctx: Context) -> None:
    """Fails on its first two runs (retry_count 0 and 1), then succeeds."""
    _count(ctx)
    if ctx.retry_count < 2:
        raise RuntimeError(f"flaky failure #{ctx.retry_count + 1}")


@ax.processor("t.sleep")
def sleep(payload: Any, ctx: Context) -> None:
    _count(ctx)
    time.sleep(float(payload["s"]))


@ax.processor("t.echo")
def echo(payload: Any, ctx: Context) -> Any:
    """Returns ``payload["value"]`` (a set when ``payload["set"]``: not JSON)."""
    _count(ctx)
    return set(payload["value"]) if payload.get("set") else payload["value"]


@ax.processor("t.hang")
def hang(payload: Any, ctx: Context) -> None:
    """Blocks until the test sets :data:`release` (at most 10 s)."""
    _count(ctx)
    release.wait(10.0)


def double(payload: Any, ctx: Context) -> int:
    """Reached only by dotted path: ``tests.procs_worker:double``."""
    _count(ctx)
    return int(payload["n"]) * 2


def _private(payload: Any, ctx: Context) -> None:
    raise AssertionError("a private function must never be called by dotted path")


async def async_dotted(payload: Any, ctx: Context) -> None:
    """An ``async def`` reached by dotted path (``tests.procs_worker:async_dotted``): awaited
    on the worker's event loop."""
    _count(ctx)


@ax.processor("t.returns_coroutine")
def returns_coroutine(payload: Any, ctx: Context) -> Any:
    """A plain function handing back a coroutine: the run fails; the body never runs."""
    return async_dotted(payload, ctx)


# --- what a failure means (issue 37) --------------------------------------------------------


@ax.processor("t.retry_in")
def retry_in(payload: Any, ctx: Context) -> str:
    """Asks for a retry in ``payload["s"]`` seconds on its first run, then succeeds."""
    _count(ctx)
    if ctx.retry_count == 0:
        raise ax.Retry(delay=float(payload["s"]), reason="not yet")
    return "done"


@ax.processor("t.snooze")
def snooze(payload: Any, ctx: Context) -> str:
    """Snoozes ``payload["s"]`` seconds on its first ``payload["times"]`` runs."""
    _count(ctx)
    if calls[ctx.task_id] <= int(payload["times"]):
        raise ax.Snooze(float(payload["s"]))
    return "woke"


@ax.processor("t.discard")
def discard(payload: Any, ctx: Context) -> None:
    _count(ctx)
    raise ax.Discard(str(payload["reason"]))


@ax.processor("t.timeouts_only", retry_on=(TimeoutError,),
              backoff=ax.Backoff(base=0.2, cap=0.2, jitter=0))
def timeouts_only(payload: Any, ctx: Context) -> None:
    """Retried only for a TimeoutError, after its own back-off of exactly 200 ms."""
    _count(ctx)
    if payload["raise"] == "timeout":
        raise TimeoutError("the gateway is slow")
    raise ValueError("bad phone number")
