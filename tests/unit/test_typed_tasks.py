"""Typed tasks (``@ax.task``, issue 39) without servers: binding and its errors, the payload
stored (on a SQLite store through ``ax.configure``), the options, the decorator's checks,
and the arguments a stored payload gives back to the function at run time."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

import ax_kombu as ax
from ax_kombu import config, facade
from ax_kombu.store.schema import tasks as task_table
from ax_kombu.tasks import install, parse_timeout
from ax_kombu.worker import processors

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def producer(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[ax.Client]:
    """The process-wide ``ax`` API on this test's SQLite store (put back afterwards)."""
    monkeypatch.setattr(config, "process_overrides", {})
    monkeypatch.setattr(facade, "_client", None)
    ax.configure(database_url=sqlite_url)
    yield ax.client()
    ax.configure()


def _rows(client: ax.Client) -> int:
    with client.store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(task_table)).scalar_one())


def _ctx(task_type: str = "t") -> ax.Context:
    return ax.Context(task_id=1, attempt=1, trace_id="x", trigger_time=0, task_type=task_type,
                      retry_count=0, max_retry=0, timeout_ms=1000)


@ax.task("typed.close", priority="high", max_retry=3, timeout="30s")
def close(order: int, note: str = "", *, ctx: ax.Context) -> str:
    return f"{order}{note}@{ctx.task_type}"


@ax.task("typed.shapes", retry_on=(TimeoutError,))
def shapes(first: int, /, second: str, *rest: int, flag: bool = False,
           **extra: Any) -> dict[str, Any]:
    return {"first": first, "second": second, "rest": list(rest), "flag": flag, "extra": extra}


@ax.task("typed.async")
async def fetch(url: str, *, ctx: ax.Context) -> str:
    await asyncio.sleep(0)
    return f"{url}#{ctx.attempt}"


def test_enqueue_stores_the_bound_arguments_by_name_with_the_decorators_options(
        producer: ax.Client) -> None:
    task_id = close.enqueue(42, delay=60, biz_key="o-42")
    view = ax.get(task_id)
    assert view.payload == {"order": 42, "note": ""}
    assert (view.task_type, view.priority, view.max_retry, view.timeout_ms, view.biz_key) == (
        "typed.close", "high", 3, 30_000, "o-42")
    assert view.status is ax.Status.DELAYED
    again = close.enqueue(order=42, note="", biz_key="o-42")  # the same key: no new task
    assert int(again) == int(task_id) and not again.created
    other = close.options(priority="slow", timeout_ms=500).enqueue(7, "!", max_retry=0)
    assert (ax.get(other).payload, ax.get(other).priority, ax.get(other).timeout_ms,
            ax.get(other).max_retry) == ({"order": 7, "note": "!"}, "slow", 500, 0)


@pytest.mark.parametrize("args, kwargs, words", [
    ((), {}, "missing a required argument: 'order'"),
    ((1, "a", "b"), {}, "too many positional arguments"),
    ((1,), {"colour": "red"}, "unexpected keyword argument 'colour'"),
    ((1,), {"ctx": None}, "unexpected keyword argument 'ctx'"),
    (({1, 2},), {}, "payload"),
])
def test_a_bad_call_is_refused_at_once_and_writes_nothing(
        producer: ax.Client, args: tuple[Any, ...], kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ax.ValidationError, match=words):
        close.enqueue(*args, **kwargs)
    with pytest.raises(ax.ValidationError):
        close.enqueue_many([close.item(1), close.item(2, delay="soon")])  # type: ignore[arg-type]
    assert _rows(producer) == 0


def test_enqueue_many_takes_items_of_this_task_only(producer: ax.Client) -> None:
    ids = close.enqueue_many([close.item(1), close.options(biz_key="k").item(2, "x")])
    assert [ax.get(i).payload for i in ids] == [{"order": 1, "note": ""}, {"order": 2, "note": "x"}]
    assert ax.get(ids[1]).biz_key == "k"
    with pytest.raises(ax.ValidationError, match="item 1: not an item of task 'typed.close'"):
        close.enqueue_many([close.item(3), shapes.item(1, "a")])
    assert _rows(producer) == 2


def test_aenqueue_writes_as_enqueue_does(producer: ax.Client) -> None:
    async def produce() -> list[ax.TaskId]:
        try:
            with pytest.raises(ax.ValidationError, match="missing a required argument"):
                await close.aenqueue()  # type: ignore[call-arg]
            first = await close.aenqueue(1, delay=60)
            second = await close.options(biz_key="a-2").aenqueue(2, "b")
            return [first, second, *await close.aenqueue_many([close.item(3)])]
        finally:
            await ax.aio.aclose()

    ids = asyncio.run(produce())
    assert [ax.get(i).payload for i in ids] == [
        {"order": 1, "note": ""}, {"order": 2, "note": "b"}, {"order": 3, "note": ""}]
    assert ax.get(ids[1]).biz_key == "a-2" and ax.get(ids[0]).status is ax.Status.DELAYED


def test_schedule_makes_a_job_whose_payload_is_the_bound_arguments(producer: ax.Client) -> None:
    job = close.schedule("typed.sweep", 0, "sweep", cron="*/5 * * * *", tz="Asia/Shanghai")
    assert (job.task_type, job.payload, job.cron, job.tz, job.priority, job.timeout_ms) == (
        "typed.close", {"order": 0, "note": "sweep"}, "*/5 * * * *", "Asia/Shanghai", "high",
        30_000)
    with pytest.raises(ax.ValidationError, match="missing a required argument"):
        close.schedule("typed.bad", every=60)  # type: ignore[call-arg]
    assert [j.name for j in ax.jobs()] == ["typed.sweep"]


def test_variadic_and_positional_only_parameters_round_trip() -> None:
    payload = shapes.payload(1, "two", 3, 4, flag=True, colour="red")
    assert payload == {"first": 1, "second": "two", "rest": [3, 4], "flag": True,
                       "extra": {"colour": "red"}}
    assert shapes.run(payload, _ctx()) == {"first": 1, "second": "two", "rest": [3, 4],
                                           "flag": True, "extra": {"colour": "red"}}


def test_a_run_gets_the_arguments_back_and_ctx_where_the_function_asks() -> None:
    assert close.run({"order": 5, "note": "!"}, _ctx("typed.close")) == "5!@typed.close"
    # a producer of an older version left a defaulted argument out: its default applies
    assert close.run({"order": 5}, _ctx()) == "5@t"
    assert close(6, ctx=_ctx()) == "6@t"  # still a plain function
    assert close.__name__ == "close" and close.__wrapped__ is not None


@pytest.mark.parametrize("payload, words", [
    ({}, r"missing: order; unexpected: -"),
    ({"order": 1, "colour": "red"}, r"missing: -; unexpected: colour"),
    ([1], "the payload is list"),
])
def test_a_payload_that_does_not_fit_discards_the_run(payload: Any, words: str) -> None:
    with pytest.raises(ax.Discard, match=words):
        close.run(payload, _ctx())


def test_an_async_function_gets_an_async_processor() -> None:
    runner = fetch.processor()
    assert processors.is_async(runner) and not processors.is_async(close.processor())
    assert asyncio.run(runner({"url": "u"}, _ctx())) == "u#1"


def test_decoration_registers_with_a_loaded_worker_with_its_policy() -> None:
    registered = processors.registered("typed.shapes")
    assert registered is not None and shapes.registered
    assert registered({"first": 1, "second": "a"}, _ctx()) == {
        "first": 1, "second": "a", "rest": [], "flag": False, "extra": {}}
    policy = processors.policy_of("typed.shapes")
    assert policy is not None and policy.retry_on == (TimeoutError,)
    assert "typed.close" not in install()  # already registered: nothing to do


@pytest.mark.parametrize("value, ms", [
    (30, 30_000), (0.25, 250), (timedelta(minutes=2), 120_000), ("250ms", 250), ("30s", 30_000),
    ("5m", 300_000), ("1h", 3_600_000), (" 1.5s ", 1500), (None, None)])
def test_timeout_forms(value: Any, ms: int | None) -> None:
    assert parse_timeout(value) == ms


@pytest.mark.parametrize("value", ["30", "5 minutes", "-1s", True, 0, "8d", 0.0001, [30]])
def test_a_bad_timeout_is_refused(value: Any) -> None:
    with pytest.raises(ax.ValidationError, match="timeout"):
        ax.task("typed.bad", timeout=value)


@pytest.mark.parametrize("options, words", [
    ({"priority": "urgent"}, "unknown priority"), ({"max_retry": -1}, "max_retry"),
    ({"retry_on": ValueError}, "retry_on"), ({"backoff": 5}, "backoff")])
def test_bad_decorator_arguments_are_refused(options: dict[str, Any], words: str) -> None:
    with pytest.raises(ax.ValidationError, match=words):
        ax.task("typed.bad", **options)


def test_a_parameter_named_like_an_option_is_refused_at_decoration() -> None:
    def clashing(order: int, delay: int, cron: str) -> None: ...

    with pytest.raises(ax.ValidationError, match="parameter.*cron, delay.*named like"):
        ax.task("typed.clash")(clashing)
    with pytest.raises(ax.ValidationError, match="unknown option"):
        close.options(colour="red")
    assert "typed.clash" not in ax.tasks.tasks()


def test_a_producer_importing_typed_tasks_loads_no_worker_and_install_registers_later() -> None:
    check = ("import sys, ax_kombu as ax\n"
             "@ax.task('x.y', timeout='1s')\n"
             "def f(a: int, *, ctx: ax.Context) -> None: ...\n"
             "assert f.payload(1) == {'a': 1} and not f.registered\n"
             "loaded = sorted(m for m in sys.modules if m.startswith('ax_kombu.worker')"
             " or m.startswith('sqlalchemy.ext.asyncio'))\n"
             "assert not loaded, loaded\n"
             "from ax_kombu.worker import processors\n"  # a worker built later, in-process
             "assert ax.tasks.install() == ['x.y'] and f.registered\n"
             "assert processors.registered('x.y')({'a': 1}, None) is None\n")
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True,
                          check=False, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
