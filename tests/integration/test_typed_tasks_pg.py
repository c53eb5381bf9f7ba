"""Typed tasks (``@ax.task``, issue 39) on PostgreSQL with a real worker: the arguments a
producer gave come back into the function (ints, strings, lists, objects, None, positional-
only and keyword-only parameters, defaults) with the run's ``ctx``; ``retry_on`` decides
which failures are retried; a payload that does not fit the signature fails at once.

As in test_worker.py the scheduler's part is done by hand (claim and publish); the worker
runs in-process, so the typed tasks below are registered when this module is imported.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

import ax_kombu as ax
from ax_kombu import config, facade
from ax_kombu.config import Settings, from_env
from ax_kombu.core.states import Status
from ax_kombu.store import transitions

from .harness import eventually
from .test_worker import Dispatch, running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

#: task_id → what the typed task was called with
seen: dict[int, dict[str, Any]] = {}


@ax.task("typed.pg.echo", priority="high", timeout="20s")
def echo(number: int, text: str, /, items: list[int], mapping: dict[str, Any],
         nothing: None = None, *, keyword: str, default: int = 7,
         ctx: ax.Context) -> dict[str, Any]:
    args = {"number": number, "text": text, "items": items, "mapping": mapping,
            "nothing": nothing, "keyword": keyword, "default": default}
    seen[ctx.task_id] = {**args, "ctx": ctx}
    return args


@ax.task("typed.pg.picky", max_retry=3, retry_on=(TimeoutError,))
def picky(kind: str) -> None:
    raise (TimeoutError if kind == "timeout" else ValueError)(f"{kind} failure")


@ax.task("typed.pg.async", timeout="5s")
async def fetch(url: str, *, tries: int = 1, ctx: ax.Context) -> str:
    await asyncio.sleep(0.01)
    seen[ctx.task_id] = {"url": url, "tries": tries, "ctx": ctx}
    return f"{url}x{tries}"


@pytest.fixture
def settings(pg_url: str, redis_broker: dict[str, str]) -> Settings:
    return from_env({}, database_url=pg_url, retry_backoff_base_ms=60_000,
                    heartbeat_interval_s=0.2, worker_grace_s=10, **redis_broker)


@pytest.fixture
def dispatch(settings: Settings, pg_url: str,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[Dispatch]:
    """The scheduler's part by hand, and the process-wide ``ax`` API on this database."""
    monkeypatch.setattr(config, "process_overrides", {})
    monkeypatch.setattr(facade, "_client", None)
    ax.configure(database_url=pg_url)
    d = Dispatch(settings)
    yield d
    d.close()
    ax.configure()


def _due(dispatch: Dispatch, *task_ids: int) -> list[int]:
    """Make the created tasks READY, then claim and publish them."""
    with dispatch.client.store.engine.begin() as conn:
        transitions.transition(conn, list(task_ids), [Status.CREATED], Status.READY)
    dispatch.dispatch(list(task_ids))
    return list(task_ids)


def test_arguments_round_trip_into_the_function_with_its_ctx(
        settings: Settings, dispatch: Dispatch) -> None:
    first = echo.enqueue(1, "one", [1, 2], {"a": {"b": [None]}}, keyword="k")
    second = echo.options(biz_key="e-2").enqueue(
        -(2**40), "déjà", [], {}, None, keyword="", default=0)
    third = echo.enqueue_many([echo.item(3, "", items=[3], mapping={"x": 1}, keyword="z")])[0]
    with running(settings):
        ids = _due(dispatch, first, second, third)
        eventually(lambda: all(dispatch.status(i) is Status.SUCCESS for i in ids))
    expected = {
        first: {"number": 1, "text": "one", "items": [1, 2], "mapping": {"a": {"b": [None]}},
                "nothing": None, "keyword": "k", "default": 7},
        second: {"number": -(2**40), "text": "déjà", "items": [], "mapping": {},
                 "nothing": None, "keyword": "", "default": 0},
        third: {"number": 3, "text": "", "items": [3], "mapping": {"x": 1}, "nothing": None,
                "keyword": "z", "default": 7},
    }
    for task_id, args in expected.items():
        call = dict(seen[task_id])
        ctx = call.pop("ctx")
        assert call == args
        assert (ctx.task_id, ctx.task_type, ctx.attempt, ctx.timeout_ms) == (
            task_id, "typed.pg.echo", 1, 20_000)
        view = dispatch.view(task_id)
        assert view.payload == args and view.result == args and view.priority == "high"


def test_an_async_def_task_enqueued_from_asyncio_runs_on_the_worker(
        settings: Settings, dispatch: Dispatch) -> None:
    async def produce() -> list[int]:
        try:
            first = await fetch.aenqueue("https://example.org/a", tries=3)
            many = await fetch.aenqueue_many([fetch.item("b"),
                                              fetch.options(biz_key="c").item("c")])
            return [int(first), *map(int, many)]
        finally:
            await ax.aio.aclose()

    ids = asyncio.run(produce())
    with running(settings):
        _due(dispatch, *ids)
        eventually(lambda: all(dispatch.status(i) is Status.SUCCESS for i in ids))
    assert [dispatch.view(i).result for i in ids] == ["https://example.org/ax3", "bx1", "cx1"]
    assert [(seen[i]["url"], seen[i]["ctx"].task_id) for i in ids] == [
        ("https://example.org/a", ids[0]), ("b", ids[1]), ("c", ids[2])]


def test_retry_on_decides_which_failures_are_retried(settings: Settings,
                                                     dispatch: Dispatch) -> None:
    retried, failed = picky.enqueue("timeout"), picky.enqueue("value")
    with running(settings):
        _due(dispatch, retried, failed)
        eventually(lambda: dispatch.status(failed) is Status.FAILED
                   and dispatch.status(retried) is Status.DELAYED)
    view = dispatch.view(retried)
    assert (view.retry_count, view.attempt, view.last_error) == (
        1, 1, "TimeoutError: timeout failure")
    view = dispatch.view(failed)
    assert (view.retry_count, view.attempt, view.max_retry) == (0, 1, 3)
    assert (view.last_error or "").startswith("ValueError: value failure")


def test_a_payload_that_does_not_fit_the_signature_fails_at_once(
        settings: Settings, dispatch: Dispatch) -> None:
    """A raw enqueue (or an older producer) left a required argument out: no retry."""
    task_id = int(ax.enqueue("typed.pg.echo", {"number": 1, "text": "t", "items": []},
                             max_retry=5))
    with running(settings):
        _due(dispatch, task_id)
        eventually(lambda: dispatch.status(task_id) is Status.FAILED)
    view = dispatch.view(task_id)
    assert (view.retry_count, view.attempt) == (0, 1) and task_id not in seen
    assert view.last_error == (
        "Discard: task 'typed.pg.echo': the payload does not fit echo(number, text, /, items, "
        "mapping, nothing=None, *, keyword, default=7) (missing: mapping, keyword; "
        "unexpected: -)")
