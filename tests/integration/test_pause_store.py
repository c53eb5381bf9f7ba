"""Pauses in the store, on SQLite and PostgreSQL, without daemons: the preload (its first
round on ``ax_task`` and its later rounds on ``ax_due``), the strays' read and the claim
leave a paused type's or queue's tasks; a task loaded before its pause is refused by the
claim and not handed back; ``Client`` stores, lists and lifts pauses and writes one audit
record for each call; a bad name changes nothing.

Tasks are read as a scheduler reads them and claimed at an explicit ``now``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import func, select

from ax_kombu.api import Client
from ax_kombu.config import PRIORITIES, Settings
from ax_kombu.exceptions import ValidationError
from ax_kombu.store import claims, pauses
from ax_kombu.store import preload as store_preload
from ax_kombu.store.audit import read_since
from ax_kombu.store.pauses import NONE, Paused
from ax_kombu.store.preload import Loaded, Share
from ax_kombu.store.schema import audit, tasks

T0 = 1_700_000_000_000
NOW = T0 + 60_000
NODE = "sched-a"
HELD = Paused(frozenset({"sms.send"}), frozenset({"slow"}))


@pytest.fixture
def client(settings: Settings) -> Iterator[Client]:
    c = Client(settings)
    yield c
    c.close()


def enqueue(client: Client, task_type: str, n: int, first: int,
            priority: str = "default") -> list[int]:
    items = [{"task_type": task_type, "payload": {"i": i, "p": priority}, "priority": priority,
              "run_at": datetime.fromtimestamp((first + i) / 1000, UTC)} for i in range(n)]
    return [int(t) for t in client.enqueue_many(items)]


def three_kinds(client: Client, first: int) -> tuple[list[int], list[int], list[int]]:
    """Tasks of a paused type, of a paused queue, and free ones, due from ``first`` on."""
    return (enqueue(client, "sms.send", 5, first), enqueue(client, "report", 5, first + 10,
                                                            "slow"),
            enqueue(client, "report", 5, first + 20))


def read(client: Client, loaded: Loaded, horizon: int,
         paused: Paused) -> tuple[list[int], Loaded]:
    with client.store.engine.begin() as conn:
        rows, loaded = store_preload.preload(conn, loaded, horizon, 10_000, paused=paused)
    return sorted(t for t, _ in rows), loaded


def claim(client: Client, ids: Sequence[int], paused: Paused, **kw: Any) -> list[int]:
    with client.store.engine.begin() as conn:
        return sorted(r.task_id for r in claims.claim(conn, ids, NODE, NOW, paused=paused,
                                                      **kw))


def statuses(client: Client, ids: Sequence[int]) -> set[str]:
    with client.store.engine.connect() as conn:
        return {r[0] for r in conn.execute(select(tasks.c.status).where(
            tasks.c.task_id.in_(list(ids))))}


def test_the_first_preload_leaves_paused_tasks(client: Client) -> None:
    typed, queued, free = three_kinds(client, T0)
    found, _ = read(client, Loaded(), NOW, HELD)
    assert found == sorted(free)
    everything, _ = read(client, Loaded(), NOW, NONE)
    assert everything == sorted(typed + queued + free)


def test_later_preloads_on_ax_due_leave_paused_tasks(client: Client) -> None:
    _, loaded = read(client, Loaded(), NOW, HELD)  # nothing yet: the next rounds read ax_due
    past = three_kinds(client, T0)  # below the read band: found as changes
    future = three_kinds(client, NOW + 1000)  # in the next band
    found, _ = read(client, loaded, NOW + 10_000, HELD)
    assert found == sorted(past[2] + future[2])
    everything, _ = read(client, loaded, NOW + 10_000, NONE)
    assert everything == sorted(t for ids in past + future for t in ids)


def test_the_strays_read_leaves_paused_tasks(client: Client) -> None:
    typed, queued, free = three_kinds(client, T0)
    ids = typed + queued + free
    # as seen by a scheduler owning none of them: share 1 of 2 reads the others
    with client.store.engine.begin() as conn:
        mine = {t for t, _ in store_preload.overdue_elsewhere(conn, NOW, Share(2, 0), 100)}
        held = {t for t, _ in store_preload.overdue_elsewhere(conn, NOW, Share(2, 0), 100,
                                                              paused=HELD)}
    assert mine and mine <= set(ids)
    assert held == mine & set(free)


def test_the_claim_refuses_a_task_loaded_before_its_pause(client: Client) -> None:
    typed, queued, free = three_kinds(client, T0)
    assert claim(client, typed + queued + free, HELD) == sorted(free)
    assert statuses(client, typed + queued) <= {"READY", "DELAYED"}
    with client.store.engine.connect() as conn:  # not handed back: dropped from memory
        assert claims.still_claimable(conn, typed + queued, paused=HELD) == []
        assert len(claims.still_claimable(conn, typed + queued)) == 10
    assert claim(client, typed + queued, NONE) == sorted(typed + queued)  # resumed: claimed


def test_the_claim_with_nothing_paused_is_the_plain_statement(client: Client) -> None:
    typed, queued, free = three_kinds(client, T0)
    assert claim(client, typed + queued + free, NONE) == sorted(typed + queued + free)


def test_only_types_or_only_queues(client: Client) -> None:
    typed, queued, free = three_kinds(client, T0)
    assert claim(client, typed + queued + free, Paused(frozenset({"sms.send"}))) == \
        sorted(queued + free)
    assert claim(client, typed, Paused(priorities=frozenset({"slow"}))) == sorted(typed)


def audit_rows(client: Client) -> list[tuple[str, str, str, str]]:
    return [(e.actor, e.via, e.action, e.target)
            for e in reversed(read_since(client.store.engine, 0))]


def test_client_pauses_lists_resumes_and_records_each_call(client: Client) -> None:
    slow = client.settings.queue_for("slow")
    assert client.pause_type("sms.send", actor="alice") is True
    assert client.pause_type("sms.send", actor="bob") is False  # kept as it was
    assert client.pause_queue(slow, actor="alice", via="cli") is True
    found = client.pauses()
    assert [(p.kind, p.name, p.actor) for p in found] == [("type", "sms.send", "alice"),
                                                          ("queue", slow, "alice")]
    assert all(p.paused_at > 0 for p in found)
    with client.store.engine.connect() as conn:
        rows = pauses.read_rows(conn)
    assert pauses.resolve(rows, client.settings.queue_for, PRIORITIES) == HELD
    assert client.resume_type("sms.send", actor="carol", via="web") is True
    assert client.resume_type("sms.send", actor="carol") is False
    assert client.resume_queue(slow, actor="alice") is True
    assert client.pauses() == []
    assert audit_rows(client) == [
        ("alice", "api", "pause_type", "type:sms.send"),
        ("bob", "api", "pause_type", "type:sms.send"),
        ("alice", "cli", "pause_queue", f"queue:{slow}"),
        ("carol", "web", "resume_type", "type:sms.send"),
        ("carol", "api", "resume_type", "type:sms.send"),
        ("alice", "api", "resume_queue", f"queue:{slow}"),
    ]


@pytest.mark.parametrize(("call", "name"), [("pause_queue", "no-such-queue"),
                                            ("pause_type", ""), ("pause_type", "x" * 129),
                                            ("resume_queue", "no-such-queue")])
def test_a_bad_name_changes_nothing(client: Client, call: str, name: str) -> None:
    with pytest.raises(ValidationError):
        getattr(client, call)(name)
    assert client.pauses() == []
    with client.store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(audit)).scalar_one() == 0
