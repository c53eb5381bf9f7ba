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
    """An ``async def`` reached by dotted path (``tests.procs_worker:async_dotted``): refused,
    its body never runs."""
    _count(ctx)


@ax.processor("t.returns_coroutine")
def returns_coroutine(payload: Any, ctx: Context) -> Any:
    """A plain function handing back a coroutine: the run fails; the body never runs."""
    return async_dotted(payload, ctx)
