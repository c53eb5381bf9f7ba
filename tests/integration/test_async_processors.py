"""``async def`` processors on a real worker, PostgreSQL and Redis (issue 39): bodies run
(never SUCCESS without running), lane slots bound them, timeouts and ``ax cancel`` cancel
the coroutine, retries mean what they mean for a sync processor.

As in test_worker.py the scheduler's part is done by hand (claim and publish). The
processors below register on import; the worker runs in this process, so a body's ledger
(``ran``, ``saw_cancel``) is read directly.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

import ax_kombu as ax
from ax_kombu.config import Settings, from_env
from ax_kombu.core.states import Status
from ax_kombu.worker.processors import Context

from .harness import eventually
from .test_processor_outcomes import _ended, _run_again_when_due
from .test_worker import Dispatch, running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

#: task_id → how many times an async body started it
ran: dict[int, int] = {}
#: task_ids whose body saw asyncio.CancelledError
saw_cancel: set[int] = set()
#: bodies in progress now, and the most at once
_now = [0, 0]
release = threading.Event()


def _start(ctx: Context) -> None:
    ran[ctx.task_id] = ran.get(ctx.task_id, 0) + 1  # the event loop's thread only


@ax.processor("a.echo")
async def echo(payload: Any, ctx: Context) -> Any:
    _start(ctx)
    await asyncio.sleep(0.01)
    return {"echo": payload, "attempt": ctx.attempt}


@ax.processor("a.gate")
async def gate(payload: Any, ctx: Context) -> None:
    """Counts how many bodies are in progress at once until the test releases them."""
    _start(ctx)
    _now[0] += 1
    _now[1] = max(_now[1], _now[0])
    try:
        while not release.is_set():
            await asyncio.sleep(0.01)
    finally:
        _now[0] -= 1


@ax.processor("a.sleepy")
async def sleepy(payload: Any, ctx: Context) -> None:
    _start(ctx)
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        saw_cancel.add(ctx.task_id)
        raise


@ax.processor("a.retry")
async def retry_later(payload: Any, ctx: Context) -> str:
    _start(ctx)
    if ctx.retry_count == 0:
        raise ax.Retry(delay=0.3, reason="not yet")
    return "done"


@ax.processor("a.picky", retry_on=(TimeoutError,))
async def picky(payload: Any, ctx: Context) -> None:
    _start(ctx)
    raise ValueError("bad phone number")


@ax.task("a.typed")
async def typed(order: int, note: str = "", *, ctx: ax.Context) -> dict[str, Any]:
    """A typed task whose function is an ``async def``: its adapter is awaited too."""
    _start(ctx)
    await asyncio.sleep(0)
    return {"order": order, "note": note}


@pytest.fixture(autouse=True)
def _ledger() -> Iterator[None]:
    ran.clear()
    saw_cancel.clear()
    _now[:] = [0, 0]
    release.clear()
    yield
    release.set()


@pytest.fixture
def settings(pg_url: str, redis_broker: dict[str, str]) -> Settings:
    return from_env({}, database_url=pg_url, retry_backoff_base_ms=300,
                    retry_backoff_max_ms=1000, retry_backoff_jitter=0.0,
                    heartbeat_interval_s=0.2, worker_grace_s=5, **redis_broker)


@pytest.fixture
def dispatch(settings: Settings) -> Iterator[Dispatch]:
    d = Dispatch(settings)
    yield d
    d.close()


def test_async_bodies_run_and_their_results_are_stored(settings: Settings,
                                                       dispatch: Dispatch) -> None:
    ids = [dispatch.enqueue("a.echo", {"i": i}) for i in range(20)]
    with running(settings) as worker:
        dispatch.dispatch(ids)
        eventually(lambda: all(dispatch.status(i) is Status.SUCCESS for i in ids))
        assert worker.stats["succeeded"] == 20
    assert ran == {i: 1 for i in ids}  # 20 bodies ran, once each: none SUCCESS unrun
    view = dispatch.view(ids[3])
    assert view.result == {"echo": {"i": 3}, "attempt": 1}


def test_the_lanes_slots_bound_async_runs_beyond_its_threads(settings: Settings,
                                                              dispatch: Dispatch) -> None:
    narrow = settings.replace(pool_default=5, lane_threads_max=2)
    ids = [dispatch.enqueue("a.gate", {"i": i}) for i in range(20)]
    with running(narrow) as worker:
        lane = next(lane for lane in worker.lanes if lane.priority == "default")
        assert len(lane.pool._threads) == 2
        dispatch.dispatch(ids)
        eventually(lambda: _now[0] == 5, what="five bodies in progress")
        eventually(lambda: lane.pool.free == 0, what="every slot taken")
        assert len(ran) == 5
        release.set()
        eventually(lambda: all(dispatch.status(i) is Status.SUCCESS for i in ids))
    assert _now[1] == 5 and ran == {i: 1 for i in ids}


def test_a_timeout_cancels_the_coroutine_and_is_retried_as_a_timeout(
        settings: Settings, dispatch: Dispatch) -> None:
    task_id = dispatch.enqueue("a.sleepy", timeout_ms=300, max_retry=1)
    with running(settings) as worker:
        dispatch.dispatch([task_id])
        eventually(partial(_ended, dispatch, task_id, 1), what="the first run recorded")
        view = dispatch.view(task_id)
        assert view.status is Status.DELAYED and view.retry_count == 1
        assert view.last_error == "timed out after 300 ms"
        assert task_id in saw_cancel and worker.stats["timed_out"] == 1
        _run_again_when_due(dispatch, task_id)
        eventually(partial(_ended, dispatch, task_id, 2), what="the second run recorded")
        assert dispatch.status(task_id) is Status.FAILED  # no retry left
        lane = next(lane for lane in worker.lanes if lane.priority == "default")
        eventually(lambda: lane.pool.free == lane.pool.size and lane.pool.overdue == 0)
    assert ran[task_id] == 2


def test_ax_cancel_of_a_running_async_task_cancels_its_coroutine(
        settings: Settings, dispatch: Dispatch) -> None:
    task_id = dispatch.enqueue("a.sleepy", timeout_ms=60_000)
    with running(settings) as worker:
        lane = next(lane for lane in worker.lanes if lane.priority == "default")
        dispatch.dispatch([task_id])
        eventually(lambda: ran.get(task_id) == 1, what="the body started")
        dispatch.client.cancel(task_id)
        eventually(lambda: task_id in saw_cancel, what="the coroutine cancelled")
        eventually(lambda: lane.pool.free == lane.pool.size, what="its slot free")
    assert dispatch.status(task_id) is Status.CANCELLED


def test_retry_and_retry_on_mean_what_they_mean_for_a_sync_processor(
        settings: Settings, dispatch: Dispatch) -> None:
    retried = dispatch.enqueue("a.retry", max_retry=3)
    refused = dispatch.enqueue("a.picky", max_retry=3)
    with running(settings):
        dispatch.dispatch([retried, refused])
        eventually(partial(_ended, dispatch, retried, 1))
        eventually(lambda: dispatch.status(refused) is Status.FAILED)
        assert dispatch.status(retried) is Status.DELAYED
        _run_again_when_due(dispatch, retried)
        eventually(lambda: dispatch.status(retried) is Status.SUCCESS)
    view = dispatch.view(refused)
    assert view.retry_count == 0 and "not one of the processor's retry_on" in (
        view.last_error or "")
    assert ran[retried] == 2 and ran[refused] == 1


def test_a_typed_async_task_runs_with_its_arguments(settings: Settings,
                                                    dispatch: Dispatch) -> None:
    typed.register()  # the worker module was imported after the decorator ran here
    task_id = dispatch.enqueue("a.typed", {"order": 42, "note": "x"})
    with running(settings):
        dispatch.dispatch([task_id])
        eventually(lambda: dispatch.status(task_id) is Status.SUCCESS)
    assert ran[task_id] == 1 and dispatch.view(task_id).result == {"order": 42, "note": "x"}
