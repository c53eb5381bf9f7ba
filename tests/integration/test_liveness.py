"""Node incarnations, fenced heartbeats and starts, bounded re-dispatch — on both stores."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime

import pytest
from sqlalchemy import select, text, update

from ax_kombu.api import Client
from ax_kombu.core.states import Status
from ax_kombu.exceptions import NodeNameInUse
from ax_kombu.store import claims, nodes, recovery, transitions
from ax_kombu.store.schema import nodes as node_table
from ax_kombu.store.schema import tasks


def dead_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    return proc.pid


def statuses(client: Client, ids: list[int]) -> dict[int, tuple[str, str | None]]:
    with client.store.engine.connect() as conn:
        rows = conn.execute(select(tasks.c.task_id, tasks.c.status, tasks.c.owner_node)
                            .where(tasks.c.task_id.in_(ids)))
        return {r[0]: (r[1], r[2]) for r in rows}


def claimed(client: Client, node: str, n: int, **enqueue: object) -> list[int]:
    """``n`` due tasks claimed (DISPATCHING, attempt 1) by ``node``."""
    ids = [int(client.enqueue("t", {"i": i, **enqueue})) for i in range(n)]
    with client.store.engine.begin() as conn:
        transitions.transition(conn, ids, [Status.CREATED], Status.READY)
        rows = claims.claim(conn, ids, node, client.store.now_ms(), due_before=2**62)
    assert len(rows) == n
    return ids


def started_ids(started: list[transitions.Started]) -> list[int]:
    return sorted(row.task_id for row in started)


def test_a_start_returns_what_each_row_stores_and_what_the_run_needs(client: Client) -> None:
    """The RUNNING move returns the stored task in the same statement: the worker runs that,
    not what a message says. Both targets, a duplicate pair, a stale attempt and an unknown
    id in one batch."""
    at = datetime.fromtimestamp((client.store.now_ms() - 500) / 1000, UTC)
    proc = int(client.enqueue("t.proc", {"n": [1, "ü"], "k": None}, run_at=at, priority="high",
                              max_retry=5, timeout_ms=4321, processor="mod.fn"))
    hook = int(client.enqueue("t.hook", [1, 2.5], run_at=at, max_retry=0,
                              callback_url="http://example.com/hook"))
    stale = int(client.enqueue("t.stale", {"s": 1}, run_at=at))
    ids = [proc, hook, stale]
    with client.store.engine.begin() as conn:
        transitions.transition(conn, ids, [Status.CREATED], Status.READY)
        claims.claim(conn, ids, "s", client.store.now_ms(), due_before=2**62)
        conn.execute(update(tasks).where(tasks.c.task_id == proc).values(retry_count=2))
        rows = {r.task_id: r for r in conn.execute(select(tasks).where(tasks.c.task_id.in_(ids)))}
        started = transitions.start_many(
            conn, [(proc, 1), (hook, 1), (proc, 1), (stale, 2), (1, 1)], "w9",
            now := client.store.now_ms())
    assert started_ids(started) == sorted([proc, hook])
    for got in started:
        row = rows[got.task_id]
        assert got == transitions.Started(
            row.task_id, row.task_type, row.trigger_time, row.priority, row.retry_count,
            row.max_retry, row.timeout_ms, row.processor_name, row.callback_url, row.payload,
            row.trace_id, started_at=now)
    by_id = {r.task_id: r for r in started}
    assert (by_id[proc].processor_name, by_id[proc].callback_url) == ("mod.fn", None)
    assert (by_id[proc].timeout_ms, by_id[proc].max_retry, by_id[proc].retry_count,
            by_id[proc].priority, by_id[proc].task_type) == (4321, 5, 2, "high", "t.proc")
    assert json.loads(by_id[proc].payload) == {"n": [1, "ü"], "k": None}
    assert (by_id[hook].processor_name, by_id[hook].callback_url) == (
        None, "http://example.com/hook")
    assert json.loads(by_id[hook].payload) == [1, 2.5] and by_id[hook].max_retry == 0
    assert statuses(client, ids) == {proc: ("RUNNING", "w9"), hook: ("RUNNING", "w9"),
                                     stale: ("DISPATCHING", "s")}


def test_a_new_incarnation_takes_over_what_the_dead_one_left(client: Client) -> None:
    old = nodes.Heartbeat(client.store, "w0", "worker")
    old.register({})
    with client.store.engine.begin() as conn:  # that process was kill -9'd
        conn.execute(update(node_table).values(pid=dead_pid()))
    waiting = [int(client.enqueue("t", {"waiting": i}, delay=60)) for i in range(2)]
    dispatching = claimed(client, "w0", 2, kind="dispatching")
    running = claimed(client, "s", 3, kind="running")
    with client.store.engine.begin() as conn:
        transitions.start_many(conn, [(t, 1) for t in running], "w0", client.store.now_ms())

    new = nodes.Heartbeat(client.store, "w0", "worker")
    took = new.register({})

    assert took == nodes.TakeOver(requeued=2, running=3)
    after = statuses(client, waiting + dispatching + running)
    assert all(after[t] == ("DELAYED", None) for t in waiting)  # nothing to take over
    assert all(after[t] == ("READY", None) for t in dispatching)
    assert all(after[t] == ("DELAYED", None) for t in running)  # retried (max_retry 3)
    assert new.incarnation > old.incarnation and new.beat({}) and not old.beat({})


def test_a_live_name_is_refused_and_nothing_changes(client: Client) -> None:
    live = nodes.Heartbeat(client.store, "s0", "scheduler")
    live.register({})
    owned = int(client.enqueue("t", {"a": 1}, delay=60))
    with client.store.engine.begin() as conn:  # the live one runs on another host
        conn.execute(update(node_table).values(host="elsewhere"))
        conn.execute(update(tasks).values(status="DELAYED", owner_node="s0"))

    with pytest.raises(NodeNameInUse, match="'s0' is in use"):
        nodes.Heartbeat(client.store, "s0", "scheduler").register({})

    assert statuses(client, [owned])[owned] == ("DELAYED", "s0")
    assert live.beat({})


def test_a_node_declared_dead_learns_it_from_its_next_beat(client: Client) -> None:
    hb = nodes.Heartbeat(client.store, "w1", "worker", silence_ms=0)
    hb.register({})
    assert hb.beat({})
    with client.store.engine.begin() as conn:
        conn.execute(update(node_table).values(heartbeat_at=0))
        assert nodes.claim_dead(conn, 1000) == ["w1"]
    assert not hb.beat({})
    hb.register({})  # the same process comes back as a new incarnation
    assert hb.beat({})


def test_a_worker_declared_dead_starts_nothing(client: Client) -> None:
    hb = nodes.Heartbeat(client.store, "w2", "worker")
    hb.register({})
    ids = claimed(client, "s", 2)
    with client.store.engine.begin() as conn:
        conn.execute(update(node_table).values(stopped_at=1))
        moved = transitions.start_many(conn, [(t, 1) for t in ids], "w2",
                                       client.store.now_ms(), incarnation=hb.incarnation)
    assert moved == []
    hb.register({})
    with client.store.engine.begin() as conn:
        moved = transitions.start_many(conn, [(t, 1) for t in ids], "w2",
                                       client.store.now_ms(), incarnation=hb.incarnation)
    assert started_ids(moved) == sorted(ids)


def test_a_start_whose_reply_was_lost_is_resumed_not_refused(client: Client) -> None:
    ids = claimed(client, "s", 3)
    now = client.store.now_ms()
    pairs = [(t, 1) for t in ids]
    with client.store.engine.begin() as conn:
        first = transitions.start_many(conn, pairs, "w3", now)
        assert started_ids(first) == sorted(ids)
    with client.store.engine.begin() as conn:  # the retry after a lost reply
        assert transitions.start_many(conn, pairs, "w3", now) == []
        resumed = transitions.start_many(conn, pairs, "w3", now, resume=True)
        assert sorted(resumed) == sorted(first)  # the same stored rows, as the lost reply had
        assert transitions.start_many(conn, pairs, "other", now, resume=True) == []
        assert transitions.start_many(conn, pairs, "w3", now + 1, resume=True) == []


def test_a_hand_back_moves_only_runs_still_running_at_their_attempt_on_its_node(
        client: Client) -> None:
    """A stopping worker's withdrawn staged runs: RUNNING → DELAYED, unheld, the rest of the
    row kept. A stale attempt, a run that ended and another node's run stay as they are."""
    back, stale, ended, other = ids = claimed(client, "s", 4)
    now = client.store.now_ms()
    with client.store.engine.begin() as conn:
        transitions.start_many(conn, [(back, 1), (stale, 1), (ended, 1)], "w4", now)
        transitions.start_many(conn, [(other, 1)], "w5", now)
        transitions.finish_many(conn, [transitions.Finish(ended, 1, Status.SUCCESS, now)])
        before = conn.execute(select(tasks).where(tasks.c.task_id == back)).one()
        assert transitions.hand_back_many(conn, [], "w4") == 0
        moved = transitions.hand_back_many(
            conn, [(back, 1), (back, 1), (stale, 2), (ended, 1), (other, 1)], "w4")
    assert moved == 1
    assert statuses(client, ids) == {back: ("DELAYED", None), stale: ("RUNNING", "w4"),
                                     ended: ("SUCCESS", "w4"), other: ("RUNNING", "w5")}
    with client.store.engine.connect() as conn:
        after = conn.execute(select(tasks).where(tasks.c.task_id == back)).one()
    kept = ("attempt", "trigger_time", "retry_count", "started_at", "dispatched_at")
    assert [after._mapping[c] for c in kept] == [before._mapping[c] for c in kept]


def test_re_dispatch_backs_off_per_attempt_and_stops_at_the_maximum(client: Client) -> None:
    (task,) = claimed(client, "s", 1)
    (slow,) = claimed(client, "s", 1, priority="slow")
    with client.store.engine.begin() as conn:
        conn.execute(update(tasks).where(tasks.c.task_id == slow).values(priority="slow"))
    ack = 1000

    def redispatch(at: int) -> list[tuple[int, str]]:
        with client.store.engine.begin() as conn:
            return recovery.redispatch_unacked(conn, at, ack, ["high", "default"], 3)

    def dispatch_again() -> int:
        now = client.store.now_ms()
        with client.store.engine.begin() as conn:
            assert len(claims.claim(conn, [task], "s", now, due_before=2**62)) == 1
        return now

    with client.store.engine.connect() as conn:
        first = conn.execute(select(tasks.c.dispatched_at).where(tasks.c.task_id == task)).scalar()
    assert first is not None
    assert redispatch(first + ack - 1) == []
    assert redispatch(first + ack + 1) == [(task, "READY")]  # 1st: after 1 × ack
    second = dispatch_again()
    assert redispatch(second + ack + 1) == []  # 2nd: after 2 × ack
    assert redispatch(second + 2 * ack + 1) == [(task, "READY")]
    third = dispatch_again()
    assert redispatch(third + 4 * ack + 1) == [(task, "FAILED")]  # the 3rd dispatch was the last
    with client.store.engine.connect() as conn:
        error = conn.execute(select(tasks.c.last_error).where(tasks.c.task_id == task)).scalar()
    assert "dispatched 3 times" in str(error)
    # the slow queue has no consumer: its task keeps its one message, never re-dispatched
    assert statuses(client, [slow])[slow][0] == "DISPATCHING"


def test_a_staged_run_recovered_before_its_trigger_time_is_retried_no_earlier(
        client: Client) -> None:
    now = client.store.now_ms()
    soon, past = (int(client.enqueue("t", {"i": i}, run_at=datetime.fromtimestamp(
        (now + d) / 1000, UTC))) for i, d in enumerate((60_000, -5_000)))
    with client.store.engine.begin() as conn:  # both fenced RUNNING by w0, one staged ahead
        conn.execute(update(tasks).where(tasks.c.task_id.in_([soon, past]))
                     .values(status="RUNNING", owner_node="w0", attempt=1))
        recovered = recovery.recover_running(conn, ["w0"], now)
        rows = {r.task_id: r for r in conn.execute(
            select(tasks.c.task_id, tasks.c.status, tasks.c.trigger_time))}
    assert sorted(t for t, _ in recovered) == sorted([soon, past])
    assert rows[soon].status == "DELAYED" and rows[soon].trigger_time == now + 60_000
    assert rows[past].status == "DELAYED" and rows[past].trigger_time == now  # retried now


def test_only_a_dead_workers_held_runs_count_as_not_run(client: Client) -> None:
    """A dead worker's RUNNING rows: a task among its listed runs never started, and gets a
    new attempt with no retry counted, whatever max_retry says; any other may have started
    and counts a retry (FAILED with none left), as do all of a node that lists none (a
    scheduler's, a Celery worker's). The history says which."""
    heart = nodes.Heartbeat(client.store, "w0", "worker")
    heart.register({})
    started = claimed(client, "s", 2, kind="started")
    listed = claimed(client, "s", 2, kind="listed")
    other = claimed(client, "s", 1, kind="celery")
    with client.store.engine.begin() as conn:
        conn.execute(update(tasks).values(max_retry=0))
        transitions.start_many(conn, [(t, 1) for t in started + listed], "w0",
                               client.store.now_ms())
        transitions.start_many(conn, [(t, 1) for t in other], "celery@h", client.store.now_ms())
        # the list is ",id,id,": an id that is a suffix or prefix of a listed one is not it
        assert heart.write_listed_runs(conn, heart.incarnation,
                                     f",{listed[0]},{listed[1]},{started[0]}1,9{started[1]},")
        assert not heart.write_listed_runs(conn, heart.incarnation + 1, ",")  # not live
        recovered = dict(recovery.recover_running(conn, ["w0", "celery@h"], client.store.now_ms()))
        rows = {r.task_id: r for r in conn.execute(
            select(tasks.c.task_id, tasks.c.status, tasks.c.retry_count, tasks.c.last_error))}
        history = dict(conn.execute(text("SELECT task_id, error FROM ax_attempt")).all())
    assert recovered == {**dict.fromkeys(started + other, "FAILED"),
                         **dict.fromkeys(listed, "DELAYED")}
    assert all((rows[t].retry_count, rows[t].last_error) == (0, "worker lost")
               for t in started + other)
    assert all((rows[t].retry_count, rows[t].last_error) == (0, recovery.UNSTARTED_ERROR)
               for t in listed)
    assert history == {**dict.fromkeys(started + other, "worker lost"),
                       **dict.fromkeys(listed, recovery.UNSTARTED_ERROR)}


def test_a_new_incarnation_recovers_by_the_held_runs_of_the_one_it_replaces(
        client: Client) -> None:
    """Registration reads the earlier incarnation's listed runs before it resets them."""
    old = nodes.Heartbeat(client.store, "w0", "worker")
    old.register({})
    started = claimed(client, "s", 1, kind="started")
    listed = claimed(client, "s", 1, kind="listed")
    with client.store.engine.begin() as conn:
        conn.execute(update(tasks).values(max_retry=0))
        transitions.start_many(conn, [(t, 1) for t in started + listed], "w0",
                               client.store.now_ms())
        assert old.write_listed_runs(conn, old.incarnation, f",{listed[0]},")
        conn.execute(update(node_table).values(pid=dead_pid()))  # kill -9'd
    new = nodes.Heartbeat(client.store, "w0", "worker")
    new.register({})
    after = statuses(client, started + listed)
    assert after == {started[0]: ("FAILED", None), listed[0]: ("DELAYED", None)}
    with client.store.engine.connect() as conn:
        assert conn.execute(select(node_table.c.listed_runs)).scalar() is None
