"""Gates on SQLite and PostgreSQL without daemons: the ordinary claim leaves gated tasks,
the gated claim starts what may start and parks the rest, a run's end wakes the next,
limits, order keys (hold_failed / skip_failed), job strategies, shards, bad input, and
racing gated claims on PostgreSQL.

Tasks are read as a scheduler reads them (``ax_kombu.store.preload.preload``, which writes nothing) and
claimed at an explicit ``now`` (no clock, no sleep).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Row, delete, func, select, update

from ax_kombu.api import Client
from ax_kombu.config import Settings, from_env
from ax_kombu.core.gating import Decision
from ax_kombu.core.states import Status
from ax_kombu.exceptions import ValidationError
from ax_kombu.store import Store, claims, gates, transitions
from ax_kombu.store import jobs as job_store
from ax_kombu.store import preload as store_preload
from ax_kombu.store.preload import Share
from ax_kombu.store.schema import limits, tasks
from ax_kombu.validation import build_row

T0 = 1_700_000_000_000  # trigger times are explicit, in the past of the wall clock
NOW = T0 + 60_000
NODE = "sched-a"
WORKER = "worker-1"


@pytest.fixture
def client(settings: Settings) -> Iterator[Client]:
    c = Client(settings)
    with c.store.engine.begin() as conn:  # the PostgreSQL fixture empties ax_task, not ax_limit
        conn.execute(delete(limits))
    yield c
    c.close()


def at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def enqueue(client: Client, task_type: str, n: int, *, first: int = 0,
            **options: Any) -> list[int]:
    """``n`` tasks of ``task_type`` due at T0 + first, T0 + first + 1, …"""
    items = [{"task_type": task_type, "payload": {"i": first + i}, "run_at": at(T0 + first + i),
              **options} for i in range(n)]
    out = client.enqueue_many(items)
    assert all(t.created for t in out)
    return [int(t) for t in out]


def preload(client: Client, now: int = NOW) -> list[int]:
    with client.store.engine.begin() as conn:
        rows, _ = store_preload.preload(conn, store_preload.Loaded(), now + 10_000, 10_000)
    return sorted(t for t, _ in rows)


def claim_plain(client: Client, ids: Sequence[int], now: int = NOW) -> list[int]:
    with client.store.engine.begin() as conn:
        return sorted(r.task_id for r in claims.claim(conn, ids, NODE, now))


def claim_gated(client: Client, ids: Sequence[int], now: int = NOW,
                node: str = NODE) -> tuple[list[Row[Any]], Decision]:
    with client.store.engine.begin() as conn:
        return gates.claim_gated(conn, ids, node, now, now)


def claimed_ids(client: Client, ids: Sequence[int], now: int = NOW) -> list[int]:
    rows, _ = claim_gated(client, ids, now)
    return sorted(r.task_id for r in rows)


def state(client: Client, ids: Sequence[int]) -> dict[int, Any]:
    with client.store.engine.connect() as conn:
        rows = conn.execute(select(tasks.c.task_id, tasks.c.status, tasks.c.owner_node, tasks.c.parked,
                                   tasks.c.gated, tasks.c.retry_count, tasks.c.attempt,
                                   tasks.c.last_error, tasks.c.trigger_time)
                            .where(tasks.c.task_id.in_(list(ids))))
        return {r.task_id: r for r in rows}


def parked(client: Client, ids: Sequence[int]) -> list[int]:
    return sorted(i for i, r in state(client, ids).items()
                  if r.status == "READY" and r.parked)


def active(client: Client, task_type: str) -> int:
    with client.store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(tasks).where(
            tasks.c.task_type == task_type,
            tasks.c.status.in_(["DISPATCHING", "RUNNING"]))).scalar_one())


def end_run(client: Client, task_id: int, status: Status = Status.SUCCESS,
            at_ms: int = NOW, ended: Sequence[tuple[str, str | None]] = ()) -> int:
    """Start and end the run of a claimed task as a worker does (same transaction as the
    wake); returns how many tasks the wake un-parked."""
    with client.store.engine.begin() as conn:
        (row,) = conn.execute(select(tasks.c.attempt).where(tasks.c.task_id == task_id)).all()
        assert transitions.start_many(conn, [(task_id, row.attempt)], WORKER, at_ms)
        assert transitions.finish_many(conn, [transitions.Finish(
            task_id, row.attempt, status, at_ms, None if status is Status.SUCCESS
            else "boom")]) == [task_id]
        return gates.wake_next(conn, ended)


def count_rows(client: Client) -> int:
    with client.store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(tasks)).scalar_one())


# -- the ordinary claim and the gated claim --------------------------------------------------


def test_the_ordinary_claim_leaves_gated_tasks_to_the_gated_claim(client: Client) -> None:
    client.set_limit("limited", 5)
    (plain,) = enqueue(client, "plain", 1)
    (keyed,) = enqueue(client, "plain", 1, first=1, order_key="acct-1")
    (limited,) = enqueue(client, "limited", 1, first=2)
    everything = [plain, keyed, limited]
    assert preload(client) == sorted(everything)
    assert claim_plain(client, everything) == [plain]
    with client.store.engine.connect() as conn:
        claimable = claims.still_claimable(conn, everything)
    assert sorted(claimable) == sorted([(keyed, T0 + 1, True), (limited, T0 + 2, True)])
    assert claimed_ids(client, [keyed, limited]) == sorted([keyed, limited])
    rows = state(client, everything)
    assert {i: (r.status, r.gated) for i, r in rows.items()} == {
        plain: ("DISPATCHING", False), keyed: ("DISPATCHING", True),
        limited: ("DISPATCHING", True)}
    assert all(r.attempt == 1 and r.owner_node == NODE for r in rows.values())


def test_the_gated_claim_leaves_tasks_not_due_or_parked(client: Client) -> None:
    client.set_limit("limited", 5)
    (due,) = enqueue(client, "limited", 1)
    (later,) = enqueue(client, "limited", 1, first=120_000)
    (waiting,) = enqueue(client, "limited", 1, first=1)
    with client.store.engine.begin() as conn:  # parked by an earlier gated claim
        conn.execute(update(tasks).where(tasks.c.task_id == waiting)
                     .values(status="READY", parked=True))
    assert preload(client) == [due]  # `later` is beyond the horizon, `waiting` is parked
    rows, decision = claim_gated(client, [later, waiting])
    assert rows == [] and decision == Decision()
    assert claimed_ids(client, [due, later, waiting]) == [due]
    assert state(client, [later])[later].status == "READY"  # due by the real clock, unclaimed
    assert parked(client, [waiting]) == [waiting]


# -- limits ------------------------------------------------------------------------------------


def test_limit_3_with_10_due_claims_3_and_parks_7(client: Client) -> None:
    client.set_limit("mail", 3)
    ids = enqueue(client, "mail", 10)
    preload(client)
    assert claim_plain(client, ids) == []
    rows, decision = claim_gated(client, ids)
    assert sorted(r.task_id for r in rows) == ids[:3]  # trigger order
    assert decision.start == ids[:3] and decision.wait == ids[3:]
    assert parked(client, ids) == ids[3:]
    assert all(r.gated for r in state(client, ids[:3]).values())
    # parked tasks are no longer owned by the node: claiming them again does nothing,
    # and no preload takes them
    assert claim_gated(client, ids[3:]) == ([], Decision())
    assert preload(client) == []
    assert parked(client, ids) == ids[3:] and active(client, "mail") == 3


def test_the_end_of_a_run_wakes_exactly_one_parked_task_of_its_type(client: Client) -> None:
    client.set_limit("mail", 3)
    ids = enqueue(client, "mail", 10)
    preload(client)
    claim_gated(client, ids)
    assert end_run(client, ids[0], ended=[("mail", None)]) == 1
    woken = [i for i, r in state(client, ids).items()
             if r.status == "READY" and not r.parked]
    assert woken == [ids[3]]  # the earliest parked
    assert parked(client, ids) == ids[4:]
    assert preload(client) == [ids[3]]
    assert claimed_ids(client, [ids[3]]) == [ids[3]]
    assert active(client, "mail") == 3 and parked(client, ids) == ids[4:]


def test_set_limit_raised_then_cleared_unparks_the_types_parked_tasks(client: Client) -> None:
    client.set_limit("mail", 1)
    ids = enqueue(client, "mail", 4)
    preload(client)
    assert claimed_ids(client, ids) == ids[:1]
    assert parked(client, ids) == ids[1:]
    client.set_limit("mail", 3)
    assert client.limits() == {"mail": 3}
    assert parked(client, ids) == []
    assert preload(client) == ids[1:]
    assert claimed_ids(client, ids[1:]) == ids[1:3]
    assert parked(client, ids) == ids[3:]
    client.set_limit("mail", None)
    assert client.limits() == {}
    assert parked(client, ids) == []
    assert preload(client) == ids[3:]
    assert claim_plain(client, ids[3:]) == ids[3:]  # no limit, no gate: the ordinary claim
    assert active(client, "mail") == 4


def test_a_lowered_limit_starts_nothing_until_runs_end_below_it(client: Client) -> None:
    client.set_limit("mail", 3)
    ids = enqueue(client, "mail", 5)
    preload(client)
    assert claimed_ids(client, ids) == ids[:3]
    client.set_limit("mail", 1)  # 3 running, limit 1; set_limit wakes the parked anyway
    assert parked(client, ids) == []
    assert preload(client) == ids[3:]
    assert claimed_ids(client, ids[3:]) == []
    assert parked(client, ids) == ids[3:]
    assert end_run(client, ids[0], ended=[("mail", None)]) == 1
    assert preload(client) == ids[3:4]
    assert claimed_ids(client, ids[3:4]) == []  # still 2 running: over the limit
    assert parked(client, ids) == ids[3:]
    end_run(client, ids[1], ended=[("mail", None)])
    end_run(client, ids[2], ended=[("mail", None)])
    assert preload(client) == ids[3:]
    assert claimed_ids(client, ids[3:]) == ids[3:4] and active(client, "mail") == 1


def test_set_limit_refuses_bad_input_and_writes_nothing(client: Client) -> None:
    for bad in (0, -1, True, 1.5, "3", 1_000_001):
        with pytest.raises(ValidationError, match="max_running"):
            client.set_limit("mail", bad)  # type: ignore[arg-type]
    for bad_type in ("", "  ", "x" * 129, None):
        with pytest.raises(ValidationError, match="task_type"):
            client.set_limit(bad_type, 2)  # type: ignore[arg-type]
    assert client.limits() == {}
    client.set_limit("mail", 1_000_000)
    client.set_limit("b", 1)
    assert client.limits() == {"b": 1, "mail": 1_000_000}


def test_the_stranded_scan_wakes_only_what_has_room(client: Client) -> None:
    """The backstop for a wake that never came: runs ended without a worker's wake (its
    worker died) leave room that wake_stranded gives to parked tasks."""
    client.set_limit("mail", 2)
    ids = enqueue(client, "mail", 5)
    keyed = enqueue(client, "acct", 3, first=5, order_key="k")
    preload(client)
    assert claimed_ids(client, ids + keyed) == [*ids[:2], keyed[0]]
    with client.store.engine.begin() as conn:
        assert gates.wake_stranded(conn) == 0  # every limit full, every key busy
    end_run(client, ids[0], ended=[])  # as if the worker died after writing: no wake
    end_run(client, keyed[0], ended=[])
    with client.store.engine.begin() as conn:
        assert gates.wake_stranded(conn) == 2  # one of 'mail' (room 1), the head of 'k'
    assert parked(client, ids + keyed) == [*ids[3:], keyed[2]]


# -- order keys --------------------------------------------------------------------------------


def test_three_keys_of_four_tasks_start_one_per_key_and_park_the_rest(client: Client) -> None:
    keys = ("a", "b", "c")
    by_key: dict[str, list[int]] = {k: [] for k in keys}
    for i in range(12):  # interleaved: a b c a b c …
        key = keys[i % 3]
        by_key[key] += enqueue(client, "acct", 1, first=i, order_key=key)
    ids = sorted(t for v in by_key.values() for t in v)
    preload(client)
    assert claim_plain(client, ids) == []
    assert claimed_ids(client, ids) == sorted(v[0] for v in by_key.values())
    assert parked(client, ids) == sorted(t for v in by_key.values() for t in v[1:])
    # the end of a's first run wakes a's next (and one more of the type, which re-parks)
    end_run(client, by_key["a"][0], ended=[("acct", "a")])
    woken = [i for i, r in state(client, ids).items()
             if r.status == "READY" and not r.parked]
    assert by_key["a"][1] in woken
    preload(client)
    assert claimed_ids(client, woken) == [by_key["a"][1]]
    assert parked(client, ids) == sorted(set(ids) - {v[0] for v in by_key.values()}
                                         - {by_key["a"][1]})


def test_a_key_starts_its_tasks_in_order_seq_then_id_order(client: Client) -> None:
    # enqueued out of trigger order: order_seq is the trigger time
    late = enqueue(client, "acct", 1, first=5, order_key="k")[0]
    early = enqueue(client, "acct", 1, first=1, order_key="k")[0]
    preload(client)
    assert claimed_ids(client, [late, early]) == [early]
    assert parked(client, [late]) == [late]


def hold_then_retry(client: Client, policy: str) -> tuple[list[int], Decision]:
    """Key 'k': A, B, C due; A runs and fails into a retry at NOW + 60 s; B (the key's
    next) comes back to the gated claim, C stays parked (the type has no limit: only the
    key's wake applies)."""
    ids = enqueue(client, "acct", 3, order_key="k", order_policy=policy)
    preload(client)
    assert claimed_ids(client, ids) == ids[:1]
    end_run(client, ids[0], Status.DELAYED, at_ms=NOW + 60_000, ended=[("acct", "k")])
    a = state(client, ids[:1])[ids[0]]
    assert (a.status, a.retry_count, a.trigger_time) == ("DELAYED", 1, NOW + 60_000)
    assert preload(client) == ids[1:2]  # B, the key's next, woken
    _, decision = claim_gated(client, ids[1:2])
    return ids, decision


def test_hold_failed_keeps_the_keys_later_tasks_waiting_for_the_retry(client: Client) -> None:
    ids, decision = hold_then_retry(client, "hold_failed")
    assert decision.start == [] and decision.wait == ids[1:2]
    assert parked(client, ids) == ids[1:]
    # the retry comes due: it is still the head and starts
    assert preload(client, now=NOW + 60_000) == ids[:1]
    rows, _ = claim_gated(client, ids[:1], now=NOW + 60_000)
    assert [(r.task_id, r.attempt) for r in rows] == [(ids[0], 2)]
    # … and its success wakes B
    end_run(client, ids[0], at_ms=NOW + 61_000, ended=[("acct", "k")])
    preload(client, now=NOW + 61_000)
    assert claimed_ids(client, ids[1:], now=NOW + 61_000) == ids[1:2]


def test_skip_failed_lets_the_keys_later_tasks_proceed(client: Client) -> None:
    ids, decision = hold_then_retry(client, "skip_failed")
    assert decision.start == ids[1:2] and decision.wait == []
    assert parked(client, ids) == ids[2:]
    assert state(client, ids[:1])[ids[0]].status == "DELAYED"


def test_skip_failed_a_due_retry_does_not_strand_its_key(client: Client) -> None:
    z = enqueue(client, "acct", 2, first=0, order_key="z")  # another key, busy throughout
    a, b, c, d = enqueue(client, "acct", 4, first=10, order_key="k",
                         order_policy="skip_failed")
    ids = [*z, a, b, c, d]
    preload(client)
    assert claimed_ids(client, ids) == sorted([z[0], a])
    end_run(client, a, Status.DELAYED, at_ms=NOW + 60_000, ended=[("acct", "k")])
    assert claimed_ids(client, preload(client)) == [b]  # B starts; z[1] re-parks
    # A's retry comes due while B runs: parked behind the busy key
    later = NOW + 60_000
    assert preload(client, now=later) == [a]
    assert claimed_ids(client, [a], now=later) == []
    assert parked(client, ids) == sorted([z[1], a, c, d])
    # B ends: the key's wake takes A (lowest order_seq), the type's wake z[1] (earliest)
    end_run(client, b, at_ms=later, ended=[("acct", "k")])
    claimed_ids(client, preload(client, now=later), now=later)
    # expected: C (the head now) or A runs; actual: A, C, D all parked, key 'k' idle
    k_running = [i for i, r in state(client, [a, c, d]).items()
                 if r.status in ("DISPATCHING", "RUNNING")]
    assert k_running != [], state(client, ids)


def test_order_key_and_limit_together(client: Client) -> None:
    client.set_limit("acct", 2)
    a = enqueue(client, "acct", 2, first=0, order_key="a")
    b = enqueue(client, "acct", 1, first=10, order_key="b")
    c = enqueue(client, "acct", 1, first=20, order_key="c")
    ids = a + b + c
    preload(client)
    _, decision = claim_gated(client, ids)
    assert decision.start == [a[0], b[0]] and decision.wait == [a[1], c[0]]
    assert active(client, "acct") == 2


# -- job strategies (occurrence rows as the materialiser writes them) -------------------------


def occurrences(client: Client, job: str, gate: str, times: Sequence[int]) -> list[int]:
    """Occurrences of ``job`` at T0 + each of ``times``, written as the materialiser does."""
    rows = []
    for i, offset in enumerate(times):
        row = build_row(client.settings, T0, "report", {"occ": i}, run_at=at(T0 + offset))
        row.update(job=job, scheduled_at=T0 + offset, gate=gate)
        rows.append(row)
    for row, task_id in zip(rows, client.ids.next_ids(len(rows)), strict=True):
        row["task_id"] = task_id
    with client.store.engine.begin() as conn:
        created = job_store.insert_occurrences(conn, rows)
    assert sorted(created) == [r["task_id"] for r in rows]
    return [r["task_id"] for r in rows]


def test_discard_cancels_an_occurrence_while_the_previous_one_runs(client: Client) -> None:
    first, second = occurrences(client, "nightly", "discard", [0, 1000])
    preload(client, now=T0 + 500)
    assert claim_plain(client, [first], now=T0 + 500) == []
    assert claimed_ids(client, [first], now=T0 + 500) == [first]
    preload(client)
    rows, decision = claim_gated(client, [second])
    assert rows == [] and [t for t, _ in decision.cancel] == [second]
    s = state(client, [first, second])
    assert s[first].status == "DISPATCHING" and s[second].status == "CANCELLED"
    assert "nightly" in s[second].last_error and str(first) in s[second].last_error


def test_cover_supersedes_the_running_occurrence_and_starts(client: Client) -> None:
    first, second = occurrences(client, "feed", "cover", [0, 1000])
    preload(client, now=T0 + 500)
    assert claimed_ids(client, [first], now=T0 + 500) == [first]
    preload(client)
    rows, decision = claim_gated(client, [second])
    assert [r.task_id for r in rows] == [second] and [t for t, _ in decision.supersede] == [first]
    s = state(client, [first, second])
    assert s[first].status == "CANCELLED" and str(second) in s[first].last_error
    assert s[second].status == "DISPATCHING" and s[second].gated


def test_cover_two_due_at_once_only_the_later_starts(client: Client) -> None:
    first, second = occurrences(client, "feed", "cover", [0, 1000])
    preload(client)
    rows, _ = claim_gated(client, [first, second])
    assert [r.task_id for r in rows] == [second]
    s = state(client, [first, second])
    assert (s[first].status, s[second].status) == ("CANCELLED", "DISPATCHING")
    assert s[first].attempt == 0  # never claimed


# -- shards ------------------------------------------------------------------------------------


def test_shards_make_one_row_each_and_are_idempotent_by_biz_key(client: Client) -> None:
    task_id = client.enqueue("reindex", {"index": "users"}, shards=4, biz_key="reindex-1")
    assert task_id.created and len(task_id.shards) == 4 and task_id.shards[0] == task_id
    views = [client.get(t) for t in task_id.shards]
    assert [(v.shard_index, v.shard_total) for v in views] == [(i, 4) for i in range(4)]
    assert len({v.fingerprint for v in views}) == 4
    assert [v.biz_key for v in views] == [f"reindex-1#{i}" for i in range(4)]
    assert all(v.payload == {"index": "users"} for v in views)
    again = client.enqueue("reindex", {"index": "users"}, shards=4, biz_key="reindex-1")
    assert again.duplicate and again == task_id and again.shards == task_id.shards
    assert count_rows(client) == 4


def test_shards_without_biz_key_dedup_by_fingerprint(client: Client) -> None:
    first = client.enqueue("reindex", {"x": 1}, shards=3, run_at=at(T0))
    again = client.enqueue("reindex", {"x": 1}, shards=3, run_at=at(T0))
    one = client.enqueue("reindex", {"x": 1}, shards=1, run_at=at(T0))
    assert again.duplicate and again.shards == first.shards
    assert one.created and len(one.shards) == 1  # 1 shard is not 3 shards' shard 0
    assert client.get(one).shard_total == 1
    assert count_rows(client) == 4


def test_a_workers_broadcast_becomes_one_shard_per_live_worker_when_claimed(
        client: Client) -> None:
    task_id = client.enqueue("cache.flush", {}, shards="workers", priority="high",
                             run_at=at(T0))
    assert task_id.shards == ()  # the workers are known only at dispatch
    preload(client)
    assert claim_plain(client, [task_id]) == []  # gated: left to the gated claim
    fresh = iter(range(9_000_000, 9_000_100))
    no_one = gates.Broadcast(lambda conn, priority: [], lambda n: [next(fresh) for _ in range(n)])
    with client.store.engine.begin() as conn:
        rows, _ = gates.claim_gated(conn, [task_id], NODE, NOW, NOW + 20, no_one)
    assert rows == [] and state(client, [task_id])[task_id].status == "READY"  # waits
    asked: list[str] = []

    def workers(conn: Any, priority: str) -> list[str]:
        asked.append(priority)
        return ["w-a", "w-b", "w-c"]

    with client.store.engine.begin() as conn:
        rows, _ = gates.claim_gated(conn, [task_id], NODE, NOW, NOW + 20,
                                    gates.Broadcast(workers, no_one.new_ids))
    assert asked == ["high"]
    assert sorted((r.target_node, r.task_id == task_id) for r in rows) == [
        ("w-a", True), ("w-b", False), ("w-c", False)]
    views = {v.target_node: v for v in (client.get(r.task_id) for r in rows)}
    assert [(views[w].shard_index, views[w].shard_total) for w in ("w-a", "w-b", "w-c")] == [
        (0, 3), (1, 3), (2, 3)]
    assert all(v.status.value == "DISPATCHING" and v.priority == "high" for v in views.values())
    assert len({v.fingerprint for v in views.values()}) == 3
    # w-b dies before its shard starts: the shard goes back for any worker, saying why
    with client.store.engine.begin() as conn:
        assert gates.retarget(conn, ["w-b"]) == [views["w-b"].task_id]
    resent = client.get(views["w-b"].task_id)
    assert (resent.status.value, resent.target_node, resent.shard_index) == ("READY", None, 1)
    assert "worker w-b died before this shard started" in (resent.last_error or "")
    preload(client)
    assert claim_plain(client, [resent.task_id]) == [resent.task_id]  # an ordinary task now


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "match"), [
    ({"order_key": "k", "order_policy": "bad"}, "order_policy"),
    ({"order_policy": "bad"}, "order_policy"),
    ({"order_key": "x" * 256}, "order_key"),
    ({"order_key": ""}, "order_key"),
    ({"order_key": 7}, "order_key"),
    ({"shards": 0}, "shards"),
    ({"shards": 1025}, "shards"),
    ({"shards": True}, "shards"),
    ({"shards": "all"}, "shards"),
    ({"shards": "workers", "order_key": "k"}, "order_key"),
    ({"shards": 1024, "biz_key": "b" * 252}, "biz_key"),
])
def test_bad_gate_or_shard_input_writes_nothing(client: Client, options: dict[str, Any],
                                                match: str) -> None:
    items = [{"task_type": "ok", "payload": {"i": i}} for i in range(5)]
    items.append({"task_type": "t", "payload": {}, **options})
    with pytest.raises(ValidationError, match=match):
        client.enqueue_many(items)
    with pytest.raises(ValidationError, match=match):
        client.enqueue("t", {}, **options)
    assert count_rows(client) == 0


def test_the_longest_order_key_and_most_shards_are_accepted(client: Client) -> None:
    keyed = client.enqueue("t", {}, order_key="k" * 255)
    assert client.get(keyed).order_key == "k" * 255
    many = client.enqueue("t", {"many": 1}, shards=1024)
    assert len(many.shards) == 1024 and count_rows(client) == 1025


# -- racing gated claims (PostgreSQL) ----------------------------------------------------------


@pytest.mark.integration
def test_racing_gated_claims_never_exceed_the_limit(pg_url: str, tmp_path: Path) -> None:
    settings = from_env({}, database_url=pg_url, auto_migrate=True,
                        broker_url=f"ax+sqlite:///{tmp_path / 'broker.sqlite3'}")
    client = Client(settings)
    stores = [Store(settings), Store(settings)]
    try:
        with client.store.engine.begin() as conn:
            conn.execute(delete(limits))
        client.set_limit("batch", 5)
        for rnd in range(25):
            ids = enqueue(client, "batch", 8, first=rnd * 100)
            loaded = {f"n{k + 1}": preload_share(client, Share(2, k)) for k in range(2)}
            assert sorted(loaded["n1"] + loaded["n2"]) == ids
            claimed = race(stores, loaded)
            assert active(client, "batch") <= 5, f"round {rnd}"
            assert len(claimed["n1"]) + len(claimed["n2"]) == 5, (rnd, claimed)
            settle(client, ids)
    finally:
        for s in stores:
            s.close()
        client.close()


def race(stores: Sequence[Store], loaded: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each node's gated claim of the ids it holds, both released at the same instant."""
    barrier = threading.Barrier(len(stores))
    claimed: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def run(store: Store, node: str) -> None:
        try:
            barrier.wait(5)
            with store.engine.begin() as conn:
                rows, _ = gates.claim_gated(conn, loaded[node], node, NOW, NOW)
            claimed[node] = [r.task_id for r in rows]
        except Exception as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s, n))
               for s, n in zip(stores, sorted(loaded), strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return claimed


def preload_share(client: Client, share: Share) -> list[int]:
    with client.store.engine.begin() as conn:
        rows, _ = store_preload.preload(conn, store_preload.Loaded(), NOW + 10_000, 10_000, share)
    return sorted(t for t, _ in rows)


def settle(client: Client, ids: Sequence[int]) -> None:
    """End the round: claimed tasks succeed, parked ones are cancelled."""
    with client.store.engine.begin() as conn:
        transitions.transition(conn, ids, [Status.DISPATCHING], Status.RUNNING)
        transitions.transition(conn, ids, [Status.RUNNING], Status.SUCCESS)
        transitions.transition(conn, ids, [Status.READY], Status.CANCELLED)
