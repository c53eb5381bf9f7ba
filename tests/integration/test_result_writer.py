"""The result writer on a real store (SQLite file and PostgreSQL): a batch the store refuses
for one outcome's data is split until that outcome is alone, which is recorded FAILED with
the reason, and the rest are written; a lost connection is retried, not split; the
outcomes waiting in memory are bounded (issue 22)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from sqlalchemy import Connection
from sqlalchemy.exc import DataError, OperationalError

from ax_kombu.config import Settings, from_env
from ax_kombu.core.states import Status
from ax_kombu.store import transitions
from ax_kombu.store.transitions import Finish
from ax_kombu.worker import outcomes, results
from ax_kombu.worker.counters import Counters
from ax_kombu.worker.pools import Outcome
from ax_kombu.worker.results import ResultWriter
from ax_kombu.worker.task import RunTask

from .harness import eventually
from .test_worker import Dispatch

pytestmark = pytest.mark.timeout(60)

NODE = "w-results"


def running(dispatch: Dispatch, n: int, **options: Any) -> list[RunTask]:
    """``n`` tasks moved RUNNING on NODE, as a worker's receipt would: each run's task as
    its started row stores it."""
    ids = [dispatch.enqueue("t.noop", {"i": i}, **options) for i in range(n)]
    messages = dispatch.claim(ids)
    with dispatch.client.store.engine.begin() as conn:
        started = transitions.start_many(conn, [(m.task_id, m.attempt) for m in messages],
                                         NODE, dispatch.client.store.now_ms())
    assert len(started) == n
    rows = {row.task_id: row for row in started}
    return [RunTask.of(rows[m.task_id], m, m.payload) for m in messages]


@pytest.fixture
def writer(dispatch: Dispatch) -> Iterator[ResultWriter]:
    w = ResultWriter(dispatch.client.store, dispatch.settings, Counters(), node=NODE)
    w.start()
    yield w
    w.stop(10)


class Refusing:
    """``finish_many`` that refuses, for its data, any batch holding one of ``poison``;
    it counts the statements tried."""

    def __init__(self, poison: set[int]) -> None:
        self.poison = poison
        self.calls = 0
        self.real = transitions.finish_many

    def __call__(self, conn: Connection, finishes: Sequence[Finish]) -> list[int]:
        self.calls += 1
        if self.poison & {f.task_id for f in finishes if f.status is not Status.FAILED
                          or not (f.error or "").startswith("outcome refused")}:
            raise DataError("UPDATE ax_task …", {}, Exception("invalid byte sequence"))
        return self.real(conn, finishes)


def final(dispatch: Dispatch, ids: list[int], timeout: float = 20) -> dict[int, Any]:
    eventually(lambda: all(dispatch.status(i) in (Status.SUCCESS, Status.FAILED)
                           for i in ids), timeout, "every task final")
    return {i: dispatch.view(i) for i in ids}


def test_a_refused_outcome_is_isolated_failed_with_the_reason_and_the_rest_written(
        dispatch: Dispatch, writer: ResultWriter, monkeypatch: pytest.MonkeyPatch) -> None:
    messages = running(dispatch, 16, max_retry=3)
    poison = messages[5].task_id
    refusing = Refusing({poison})
    monkeypatch.setattr(transitions, "finish_many", refusing)
    for m in messages:
        writer.put(m, Outcome(True, value={"i": m.task_id}))
    views = final(dispatch, [m.task_id for m in messages])

    assert views[poison].status is Status.FAILED
    assert (views[poison].last_error or "").startswith(
        "outcome refused by the store (DataError: ")
    assert "the run ended SUCCESS" in (views[poison].last_error or "")
    rest = [v for i, v in views.items() if i != poison]
    assert all(v.status is Status.SUCCESS and v.result == {"i": v.task_id} for v in rest)
    assert writer.stats["refused_results"] == 1
    assert refusing.calls <= 2 + 2 * 4 + 1  # halved down to one of 16, then the FAILED write


def test_a_lost_connection_is_retried_whole_not_split(
        dispatch: Dispatch, writer: ResultWriter, monkeypatch: pytest.MonkeyPatch) -> None:
    messages = running(dispatch, 4, max_retry=0)
    real, failures = transitions.finish_many, [2]

    def flaky(conn: Connection, finishes: Sequence[Finish]) -> list[int]:
        if failures[0]:
            failures[0] -= 1
            raise OperationalError("UPDATE ax_task …", {}, Exception("server closed"))
        return real(conn, finishes)

    monkeypatch.setattr(transitions, "finish_many", flaky)
    for m in messages:
        writer.put(m, Outcome(False, error=RuntimeError("boom")))
    views = final(dispatch, [m.task_id for m in messages])
    assert all(v.status is Status.FAILED and v.last_error == "RuntimeError: boom"
               for v in views.values())
    assert writer.stats["refused_results"] == 0


def test_errors_and_values_with_nul_or_surrogates_are_stored_readably(
        dispatch: Dispatch, writer: ResultWriter) -> None:
    nul_error, huge_error, nul_value, odd_value, plain = running(dispatch, 5, max_retry=0)
    writer.put(nul_error, Outcome(False, error=ValueError("bad\x00byte")))
    writer.put(huge_error, Outcome(False, error=RuntimeError("y" * 2_000_000)))
    writer.put(nul_value, Outcome(True, value="bad\x00byte"))
    writer.put(odd_value, Outcome(True, value=["file \udc80.txt"]))
    writer.put(plain, Outcome(True, value=1))
    views = final(dispatch, [nul_error.task_id, huge_error.task_id, nul_value.task_id,
                             odd_value.task_id, plain.task_id])
    assert views[nul_error.task_id].last_error == "ValueError: bad\\x00byte"
    huge = views[huge_error.task_id].last_error or ""
    assert len(huge) == outcomes.MAX_ERROR and huge.endswith("characters in all]")
    assert views[nul_value.task_id].result == "bad\x00byte"
    assert views[odd_value.task_id].result == ["file \udc80.txt"]
    assert views[plain.task_id].result == 1
    assert {v.status for k, v in views.items()} == {Status.FAILED, Status.SUCCESS}


def test_outcomes_waiting_in_memory_are_bounded_and_told_when_durable(
        dispatch: Dispatch, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = dispatch.settings.replace(worker_batch_size=1)
    writer = ResultWriter(dispatch.client.store, settings, Counters(), node=NODE)
    assert writer.bound == 2
    messages = running(dispatch, 4, max_retry=0)
    gate, real = threading.Event(), transitions.finish_many

    def held(conn: Connection, finishes: Sequence[Finish]) -> list[int]:
        assert gate.wait(20)
        return real(conn, finishes)

    monkeypatch.setattr(transitions, "finish_many", held)
    durable: list[int] = []
    writer.start()
    try:
        for m in messages[:2]:  # the bound: taken at once
            writer.put(m, Outcome(True), on_durable=lambda i=m.task_id: durable.append(i))
        third = threading.Thread(target=writer.put, args=(messages[2], Outcome(True)))
        third.start()
        third.join(0.5)
        assert third.is_alive(), "a put past the bound did not wait"
        # an abandoned run's outcome (reported by the stopping thread) never waits
        writer.put(messages[3], Outcome(False, abandoned="worker shut down"))
        assert durable == []
        gate.set()
        third.join(10)
        assert not third.is_alive()
        eventually(lambda: sorted(durable) == sorted(m.task_id for m in messages[:2]),
                   10, "on_durable called for both")
    finally:
        gate.set()
        assert writer.stop(10)
    assert writer.stats["outcome_waits"] == 1
    views = final(dispatch, [m.task_id for m in messages])
    assert [views[m.task_id].status for m in messages] == [Status.SUCCESS] * 3 + [Status.FAILED]


@pytest.mark.integration
def test_a_value_postgresql_refuses_is_isolated(
        pg_url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real refusal by PostgreSQL (a DataError: a time past BIGINT), not one the
    sanitiser prevents: that run alone is FAILED with the reason, the rest are written."""
    settings: Settings = from_env({}, database_url=pg_url, auto_migrate=True,
                                  broker_url=f"ax+sqlite:///{tmp_path / 'broker.sqlite3'}")
    dispatch = Dispatch(settings)
    writer = ResultWriter(dispatch.client.store, settings, Counters(), node=NODE)
    try:
        messages = running(dispatch, 8)
        poison = messages[3].task_id
        real_decide = results.decide

        def out_of_range(result: outcomes.RunResult, *args: Any) -> Finish:
            finish = real_decide(result, *args)
            return finish._replace(at_ms=2**63) if result.task.task_id == poison else finish

        monkeypatch.setattr(results, "decide", out_of_range)
        writer.start()
        for m in messages:
            writer.put(m, Outcome(True, value=m.task_id))
        views = final(dispatch, [m.task_id for m in messages])
    finally:
        writer.stop(10)
        dispatch.close()
    assert views[poison].status is Status.FAILED
    assert (views[poison].last_error or "").startswith(
        "outcome refused by the store (DataError: ")
    assert "out of range" in (views[poison].last_error or "")
    assert all(v.status is Status.SUCCESS and v.result == i
               for i, v in views.items() if i != poison)


def test_finish_many_writes_only_storable_text(dispatch: Dispatch) -> None:
    """The store's own guard, for every caller (the Celery bootstep writes its own ends)."""
    nul, odd = running(dispatch, 2)
    with dispatch.client.store.engine.begin() as conn:
        moved = transitions.finish_many(conn, [
            Finish(nul.task_id, nul.attempt, Status.FAILED, 1, "bad\x00byte \udc80"),
            Finish(odd.task_id, odd.attempt, Status.SUCCESS, 1, result='"file \udc80"')])
    assert sorted(moved) == sorted([nul.task_id, odd.task_id])
    assert dispatch.view(nul.task_id).last_error == "bad\\x00byte \\udc80"
    assert dispatch.view(odd.task_id).result == "file \udc80"
