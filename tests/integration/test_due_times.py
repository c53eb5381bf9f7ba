"""``ax_due`` (migration 0016): the times claimable tasks fall due, kept by the database
whoever writes, read by the scheduler's steady preload rounds. What writes an entry and
what does not, the migration of existing tasks, an out-of-date entry refused by the claim,
the prune that keeps whatever is still due (also as a running scheduler makes it), and
(PostgreSQL) the plans of a steady round.
On SQLite and PostgreSQL unless marked."""

from __future__ import annotations

import functools
import threading
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import Engine, bindparam, text

from ax_kombu.api import Client
from ax_kombu.store import preload
from ax_kombu.store.admin import retry_tasks
from ax_kombu.store.claims import claim, still_claimable
from ax_kombu.store.engine import migrate
from ax_kombu.store.preload import Loaded, Share

from ..waiting import eventually
from .harness import task_row

pytestmark = [pytest.mark.timeout(60)]


def _entries(engine: Engine) -> list[tuple[int, int]]:
    """Every entry, as (task_id, trigger_time), in the order they were written."""
    with engine.connect() as conn:
        return [(r[0], r[1]) for r in conn.execute(text(
            "SELECT task_id, trigger_time FROM ax_due ORDER BY armed, task_id, trigger_time"))]


def _set(engine: Engine, task_id: int, **values: Any) -> None:
    """An UPDATE of ``values`` on one row, as any writer (older code, an operator) makes it."""
    sets = ", ".join(f"{k} = :{k}" for k in values)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE ax_task SET {sets} WHERE task_id = :id"),
                     {**values, "id": task_id})


def _time(engine: Engine, task_id: int) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT trigger_time FROM ax_task WHERE task_id = :id"),
                                {"id": task_id}).scalar_one())


def test_migration_0016_gives_each_due_task_an_entry(empty_store: Engine) -> None:
    migrate(empty_store, "0015")
    old = functools.partial(task_row, node_column="last_run_node")  # 0015's column
    rows = [old(1, 5_000, "DELAYED"), old(2, 6_000, "READY", node="~parked"),
            old(3, 7_000, "SUCCESS", node="w1"), old(4, 8_000, "CREATED"),
            old(5, 9_000, "READY"), old(6, 9_500, "DISPATCHING", node="s1")]
    with empty_store.begin() as conn:
        conn.execute(text(f"INSERT INTO ax_task ({', '.join(rows[0])}) VALUES "
                          f"({', '.join(':' + k for k in rows[0])})"), rows)
    migrate(empty_store)
    assert sorted(_entries(empty_store)) == [(1, 5_000), (4, 8_000), (5, 9_000)]
    # and the database keeps them from now on
    with empty_store.begin() as conn:
        conn.execute(text("UPDATE ax_task SET parked = false WHERE task_id = 2"))
    assert sorted(_entries(empty_store))[1] == (2, 6_000)


def test_each_way_a_task_falls_due_writes_one_entry_and_nothing_else_does(
        client: Client) -> None:
    """Enqueued, sent back to READY, woken from parked, retried after a failure (by a
    worker's backoff or ``ax retry``), given a new time: one entry each. Claimed, started,
    failed, cancelled, parked, or updated otherwise while waiting: none."""
    engine = client.store.engine
    at = datetime.fromtimestamp((client.store.now_ms() + 30_000) // 1000, UTC)
    a, b, c, d = (int(client.enqueue("t", {"i": i}, run_at=at)) for i in range(4))
    due = _time(engine, a)
    written = [(t, due) for t in (a, b, c, d)]
    assert _entries(engine) == written  # one statement: one entry per task
    many = [int(t) for t in client.enqueue_many(  # PostgreSQL: by COPY
        [{"task_type": "t", "payload": {"many": i}, "delay": 30} for i in range(30)])]
    assert sorted(t for t, _ in _entries(engine)[4:]) == sorted(many)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM ax_due WHERE task_id IN :ids").bindparams(
            bindparam("ids", expanding=True)), {"ids": many})
    now = client.store.now_ms()
    with engine.begin() as conn:
        assert len(claim(conn, [a, b], "s1", now, due_before=due)) == 2
    _set(engine, a, status="RUNNING")
    _set(engine, a, status="FAILED", finished_at=now)
    _set(engine, d, status="CANCELLED", finished_at=now)
    _set(engine, c, parked=True)
    _set(engine, c, priority="high")  # parked: nothing
    _set(engine, c, payload='{"i": 22}')
    assert _entries(engine) == written
    _set(engine, b, status="READY", owner_node=None)  # the ack timeout sends it again
    _set(engine, c, parked=False)  # woken
    written += [(b, due), (c, due)]
    assert _entries(engine) == written
    with engine.begin() as conn:  # ax retry: due now
        assert sorted(retry_tasks(conn, [a, d])) == sorted([a, d])
    written += sorted([(a, _time(engine, a)), (d, _time(engine, d))])
    assert sorted(_entries(engine)[-2:]) == written[-2:]
    _set(engine, b, status="RUNNING")
    _set(engine, b, status="DELAYED", trigger_time=due + 5_000)  # a retry's backoff
    _set(engine, c, trigger_time=due + 9_000)  # moved while waiting
    _set(engine, c, trigger_time=due + 9_000, priority="slow")  # same time: nothing
    assert _entries(engine) == [*written, (b, due + 5_000), (c, due + 9_000)]


def test_a_steady_round_hands_over_out_of_date_entries_and_the_claim_refuses_them(
        client: Client) -> None:
    """A task moved later and a cancelled one still have their entries in the band: the
    round returns them, the claim moves neither, and :func:`still_claimable` gives the
    moved one's real time (the claimer hands it back at that time) and drops the other."""
    engine = client.store.engine
    at = datetime.fromtimestamp((client.store.now_ms() + 5_000) // 1000, UTC)
    moved, cancelled, kept = (int(client.enqueue("t", {"i": i}, run_at=at)) for i in range(3))
    due = _time(engine, moved)
    with engine.begin() as conn:  # read up to a second before they are due
        _, loaded = preload.preload(conn, Loaded(), due - 1000, 1000)
    _set(engine, moved, trigger_time=due + 60_000)
    _set(engine, cancelled, status="CANCELLED")
    with engine.begin() as conn:
        rows, _ = preload.preload(conn, loaded, due + 10_000, 1000)
    assert sorted(rows) == sorted([(moved, due), (cancelled, due), (kept, due)])
    with engine.begin() as conn:
        claimed = claim(conn, [moved, cancelled, kept], "s1", due, due_before=due)
        assert [r.task_id for r in claimed] == [kept]
        assert still_claimable(conn, [moved, cancelled]) == [(moved, due + 60_000, False)]
    with engine.begin() as conn:  # its new entry is beyond the window read
        rows, _ = preload.preload(conn, loaded._replace(until=due + 10_000), due + 70_000,
                                   1000)
    assert rows == [(moved, due + 60_000)]


def test_the_prune_deletes_only_entries_whose_task_has_moved_on(client: Client) -> None:
    """Past entries of tasks claimed, cancelled, parked, removed or moved go; the entry of a
    task still due at its time stays however overdue, and so does every entry whose time
    has not passed. Each scheduler prunes only its share's."""
    engine = client.store.engine
    now = client.store.now_ms()
    ids = [int(client.enqueue("t", {"i": i}, delay=0)) for i in range(6)]
    claimed, cancelled, parked, removed, moved, overdue = ids
    future = int(client.enqueue("t", {"i": "later"}, delay=3600))
    with engine.begin() as conn:
        claim(conn, [claimed], "s1", now + 1000, due_before=now + 1000)
        conn.execute(text("DELETE FROM ax_task WHERE task_id = :id"), {"id": removed})
    _set(engine, cancelled, status="CANCELLED")
    _set(engine, parked, parked=True)
    _set(engine, moved, trigger_time=now + 7_200_000)
    before = client.store.now_ms() + 1000
    stale = {claimed, cancelled, parked, removed, moved}
    for k in (0, 1):  # two schedulers, each its own share
        mine = {t for t in stale if _part(t, 2) == k}
        with engine.begin() as conn:
            assert preload.prune_due(conn, before, 1000, Share(2, k)) == len(mine)
        gone = {t for t in stale if _part(t, 2) <= k}  # this share's and those before
        assert {t for t, at in _entries(engine) if at < before} == (stale - gone) | {overdue}
    assert sorted(_entries(engine)) == sorted([
        (overdue, _time(engine, overdue)), (future, _time(engine, future)),
        (moved, now + 7_200_000)])
    with engine.begin() as conn:  # nothing more: the rest is still due
        assert preload.prune_due(conn, before + 10_000_000, 1000) == 0


def test_a_running_scheduler_prunes_the_entries_left_behind(client: Client) -> None:
    """The housekeeper's ``due`` step, in a running scheduler: the entries more than
    ``DUE_PRUNE_AFTER_MS`` past whose task has moved on (gone, as an archive leaves them,
    or due at another time now) are deleted and counted in ``ax_due_pruned_total``; a
    recent one is kept, and so is the entry of the task's current time."""
    from prometheus_client import REGISTRY

    from ax_kombu.scheduler.housekeeper import DUE_PRUNE_AFTER_MS
    from ax_kombu.scheduler.node import Scheduler

    engine = client.store.engine
    now = client.store.now_ms()
    old, recent = now - DUE_PRUNE_AFTER_MS - 60_000, now - DUE_PRUNE_AFTER_MS // 2
    waiting = int(client.enqueue("due.waits", {}, delay=3600))  # due in an hour
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO ax_due (task_id, trigger_time, runner, armed) "
                          "VALUES (1, :old, 'ax', 1), (2, :old, 'ax', 1), "
                          "(3, :recent, 'ax', 1), (:waiting, :old, 'ax', 1)"),
                     {"old": old, "recent": recent, "waiting": waiting})
    counted = REGISTRY.get_sample_value("ax_due_pruned_total") or 0.0
    scheduler = Scheduler(client.settings, "s-due")
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    try:
        eventually(lambda: not any(at == old for _, at in _entries(engine)), 20,
                   "the old entries pruned")
    finally:
        scheduler.request_stop()
        thread.join(30)
    assert not thread.is_alive()
    assert sorted(_entries(engine)) == sorted([(3, recent), (waiting, _time(engine, waiting))])
    assert (REGISTRY.get_sample_value("ax_due_pruned_total") or 0.0) - counted == 3


def _part(task_id: int, of: int) -> int:
    """The share ``task_id`` falls in among ``of`` (:func:`ax_kombu.store.preload.share_key`)."""
    return ((task_id >> 22) + ((task_id >> 12) & 1023) + (task_id & 4095)) % of


@pytest.mark.integration
def test_a_steady_round_reads_ax_due_alone_through_its_indexes(pg_url: str) -> None:
    """PostgreSQL: after the first round, a preload reads ``ax_due`` and never ``ax_task``;
    what changed comes through ``ix_ax_due_armed`` even with many entries of the past yet to
    be pruned (read in time order they would all be walked), and the band through
    ``ix_ax_due_time``."""
    from ax_kombu.config import from_env

    client = Client(from_env({}, database_url=pg_url))
    engine = client.store.engine
    try:
        with engine.begin() as conn:  # 50,000 entries of the past, whose tasks ran
            conn.execute(text("INSERT INTO ax_due (task_id, trigger_time, runner, armed) "
                              "SELECT i, 1000 + i, 'ax', 1 FROM generate_series(1, 50000) i"))
            conn.execute(text("ANALYZE ax_due"))
        now = client.store.now_ms()
        with engine.begin() as conn:
            _, loaded = preload.preload(conn, Loaded(), now + 10_000, 1000)
        ids = sorted(int(client.enqueue("t", {"i": i}, delay=d))
                     for i, d in enumerate((0, 5, 20)))
        statements: list[str] = []
        with engine.begin() as conn:
            rows, _ = _explained(conn, statements, lambda: preload.preload(
                conn, loaded, now + 30_000, 1000, Share(1, 0), 250))
        assert sorted(t for t, _ in rows) == ids
        reads = [s for s in statements if "ax_due" in s or "ax_task" in s]
        assert len(reads) == 2 and all("ax_task" not in s for s in reads), reads
        changed, band = reads
        assert "ix_ax_due_armed" in changed and "ix_ax_due_time" not in changed, changed
        assert "Index Scan using ix_ax_due_time" in band, band
    finally:
        client.close()


def _explained(conn: Any, out: list[str], call: Any) -> Any:
    """Run ``call`` with each statement on ``conn`` explained (ANALYZE: it runs too) into
    ``out``; returns what ``call`` returns."""
    from sqlalchemy import event

    def explain(_conn: Any, cursor: Any, sql: str, parameters: Any, _context: Any,
                _many: bool) -> None:
        if sql.lstrip().upper().startswith(("SELECT", "WITH")) and "set_config" not in sql:
            cursor.execute("EXPLAIN (ANALYZE, COSTS OFF) " + sql, parameters)
            out.append("\n".join(r[0] for r in cursor.fetchall()))

    event.listen(conn, "before_cursor_execute", explain)
    try:
        return call()
    finally:
        event.remove(conn, "before_cursor_execute", explain)
