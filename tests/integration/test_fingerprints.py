"""The duplicate check's own table, ``ax_fingerprint`` (migration 0012): written once at
enqueue, never by a status change; a task keeps counting as a duplicate through its life
(until cancelled, archived or purged); migration 0012 carries existing tasks over.
On SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import Engine, event, inspect, text

from ax_kombu.api import Client
from ax_kombu.core.ids import compose
from ax_kombu.core.states import Status
from ax_kombu.store.admin import purge_finished
from ax_kombu.store.archive import archive_finished
from ax_kombu.store.engine import migrate
from ax_kombu.store.enqueue import PROBE_BUCKET_BITS, PROBE_SQL, Written, insert_tasks, probes
from ax_kombu.store.tasks import prune_fingerprints

from .harness import task_row


def _pairs(written: list[Written]) -> list[tuple[int, bool]]:
    """``(task_id, created)`` of each row written."""
    return [(w.task_id, w.created) for w in written]

def _entries(engine: Engine) -> list[tuple[str, int, int]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(
            "SELECT fingerprint, trigger_time, task_id FROM ax_fingerprint ORDER BY task_id"))]


def _finish(engine: Engine, task_id: int, status: str, finished_at: int) -> None:
    """The row as a worker leaves it (claimed, run, ended): three status changes."""
    with engine.begin() as conn:
        for step in ("DISPATCHING", "RUNNING", status):
            conn.execute(text("UPDATE ax_task SET status = :s, attempt = 1, "
                              "finished_at = :f WHERE task_id = :id"),
                         {"s": step, "f": finished_at, "id": task_id})


def test_each_task_gets_one_entry_that_its_status_changes_leave_alone(client: Client) -> None:
    engine = client.store.engine
    one = client.enqueue("push", {"a": 1}, delay=0)
    many = client.enqueue_many([{"task_type": "push", "payload": {"n": i}, "delay": 60}
                                for i in range(40)])  # > 20 rows: COPY on PostgreSQL
    entries = _entries(engine)
    view = client.get(one)
    assert (view.fingerprint, view.trigger_time, int(one)) in entries
    assert sorted(e[2] for e in entries) == sorted([int(one), *map(int, many)])
    _finish(engine, one, "SUCCESS", client.store.now_ms())
    assert _entries(engine) == entries


def test_a_task_that_already_ran_still_makes_a_retried_enqueue_a_duplicate(
        client: Client) -> None:
    first = client.enqueue("coupon", {"user": 7}, delay=0)
    _finish(client.store.engine, first, "SUCCESS", client.store.now_ms())
    again = client.enqueue("coupon", {"user": 7}, delay=0)  # a producer retrying
    assert again == first and again.duplicate


def test_the_window_is_the_trigger_time_the_producer_asked_for(client: Client) -> None:
    """A retry's backoff moves the row's trigger time; the duplicate check keeps to the
    time the task was enqueued for."""
    first = client.enqueue("push", {"x": 1}, delay=100)
    asked = client.get(first).trigger_time
    with client.store.engine.begin() as conn:
        conn.execute(text("UPDATE ax_task SET trigger_time = trigger_time + 600000 "
                          "WHERE task_id = :id"), {"id": first})
    near_asked = client.enqueue("push", {"x": 1},
                                run_at=datetime.fromtimestamp((asked + 10) / 1000, UTC))
    assert near_asked == first and near_asked.duplicate


def test_purge_and_archive_take_a_task_s_entry_with_it(client: Client) -> None:
    engine = client.store.engine
    old = client.store.now_ms() - 3_600_000
    archived = compose(old, 0, 1)  # archive takes tasks by their id's time too
    insert_tasks(engine, [task_row(archived, old, fingerprint="a" * 32)], window_ms=5_000)
    gone, kept = (client.enqueue("t", {"i": i}, delay=0) for i in range(2))
    _finish(engine, gone, "FAILED", old)
    _finish(engine, archived, "SUCCESS", old)
    assert purge_finished(engine, Status.FAILED, 60_000).tasks == 1
    assert archive_finished(engine, 60_000).tasks == 1
    assert [e[2] for e in _entries(engine)] == [int(kept)]
    # the purged and archived tasks duplicate nothing any more
    again = task_row(archived + 1, old, fingerprint="a" * 32)
    assert insert_tasks(engine, [again], 5_000)[0][1] is True
    assert client.enqueue("t", {"i": 0}, delay=0).created
    assert client.enqueue("t", {"i": 1}, delay=0).duplicate


def test_migration_0012_carries_the_existing_fingerprints_over(empty_store: Engine) -> None:
    migrate(empty_store, "0011")
    base = {"redispatches": 0, "gated": False}
    rows = [{**task_row(1, 5_000, fingerprint="a" * 32), **base},
            {**task_row(2, 5_000, fingerprint="b" * 32), **base, "status": "SUCCESS"},
            {**task_row(3, 5_000, fingerprint="c" * 32), **base, "status": "CANCELLED"}]
    columns = ", ".join(rows[0])
    with empty_store.begin() as conn:  # as written before 0012
        conn.execute(text(f"INSERT INTO ax_task ({columns}) VALUES "
                          f"({', '.join(':' + k for k in rows[0])})"), rows)
    migrate(empty_store)
    assert _entries(empty_store) == [("a" * 32, 5_000, 1), ("b" * 32, 5_000, 2),
                                     ("c" * 32, 5_000, 3)]
    names = {i["name"] for i in inspect(empty_store).get_indexes("ax_task")}
    assert "ix_ax_task_fingerprint" not in names
    again = [task_row(10 + r["task_id"], 5_100, fingerprint=r["fingerprint"]) for r in rows]
    found = _pairs(insert_tasks(empty_store, again, window_ms=5_000))
    # the pending and the finished task are duplicates; the cancelled one is not
    assert found == [(1, False), (2, False), (13, True)]


def test_the_prune_deletes_only_entries_old_and_already_due(client: Client) -> None:
    """Entries of tasks created before the retention and due before the window go; a task
    created earlier but due later keeps its entry (a duplicate may still come before it
    fires), as does a recent one. The kept ones still make duplicates."""
    now = client.store.now_ms()
    day = 86_400_000
    with client.store.engine.begin() as conn:  # three tasks, created two days ago
        conn.execute(text("INSERT INTO ax_fingerprint (fingerprint, trigger_time, task_id) "
                          "VALUES ('a', :past, :old1), ('b', :future, :old2), ('c', :past, :new)"),
                     {"past": now - day, "future": now + day, "old1": compose(now - 2 * day, 1, 1),
                      "old2": compose(now - 2 * day, 1, 2), "new": compose(now - 1000, 1, 3)})
        assert prune_fingerprints(conn, compose(now - day // 2, 0, 0), now - 5000, limit=1) == 1
        assert prune_fingerprints(conn, compose(now - day // 2, 0, 0), now - 5000) == 0
    assert sorted(e[0] for e in _entries(client.store.engine)) == ["b", "c"]
    first = int(client.enqueue("t.kept", {"k": 1}, delay=60))
    with client.store.engine.begin() as conn:
        prune_fingerprints(conn, compose(now + 60_000, 0, 0), client.store.now_ms() - 5000)
    assert int(client.enqueue("t.kept", {"k": 1}, delay=60)) == first  # due later: kept


def test_migration_0015_keys_postgresql_s_entries_by_a_hash_of_the_fingerprint(
        empty_store: Engine) -> None:
    """PostgreSQL: the B-tree primary key gives way to a hash index on the fingerprint (one
    page per probe, whatever the table's size), the entries stay and still make duplicates;
    SQLite keeps its primary key."""
    migrate(empty_store, "0014")
    insert_tasks(empty_store, [task_row(1, 5_000, fingerprint="a" * 32),
                               task_row(2, 9_000, fingerprint="b" * 32)], 5_000)
    migrate(empty_store, "0015")
    key = inspect(empty_store).get_pk_constraint("ax_fingerprint")["constrained_columns"]
    with empty_store.connect() as conn:
        if conn.dialect.name == "postgresql":
            assert key == []
            made = conn.execute(text("SELECT indexdef FROM pg_indexes WHERE indexname = "
                                     "'ix_ax_fingerprint_hash'")).scalar_one()
            assert "USING hash (fingerprint)" in made
        else:
            assert key == ["fingerprint", "trigger_time", "task_id"]
    assert _entries(empty_store) == [("a" * 32, 5_000, 1), ("b" * 32, 9_000, 2)]
    found = _pairs(insert_tasks(empty_store, [task_row(3, 6_000, fingerprint="a" * 32),
                                       task_row(4, 20_000, fingerprint="b" * 32)],
                         5_000))
    assert found == [(1, False), (4, True)]  # 2 is 11 s away: outside the window


def test_migration_0017_keys_postgresql_s_entries_by_their_probe(empty_store: Engine) -> None:
    """PostgreSQL: the hash index gives way to a B-tree on each entry's probe (trigger
    time's bucket, then 32 bits of the fingerprint), analysed; the entries stay and still
    make duplicates, also across a bucket's edge. SQLite is unchanged."""
    edge = 7 << PROBE_BUCKET_BITS  # the first millisecond of a bucket
    migrate(empty_store, "0016")
    insert_tasks(empty_store, [task_row(1, edge - 1_000, fingerprint="a" * 32),
                               task_row(2, 9_000, fingerprint="b" * 32)],
                 5_000)
    migrate(empty_store)
    with empty_store.connect() as conn:
        if conn.dialect.name == "postgresql":
            made = {r[0]: r[1] for r in conn.execute(text(
                "SELECT indexname, indexdef FROM pg_indexes "
                "WHERE tablename = 'ax_fingerprint'"))}
            assert "ix_ax_fingerprint_hash" not in made
            assert "trigger_time >> 20" in made["ix_ax_fingerprint_probe"]
            assert conn.execute(text(  # the expression's statistics, for the planner
                "SELECT count(*) FROM pg_stats WHERE tablename = 'ix_ax_fingerprint_probe'"
            )).scalar_one() == 1
    assert _entries(empty_store) == [("a" * 32, edge - 1_000, 1), ("b" * 32, 9_000, 2)]
    found = _pairs(insert_tasks(empty_store, [task_row(3, edge + 2_000, fingerprint="a" * 32),  # the next bucket
                                       task_row(4, 20_000, fingerprint="b" * 32)], 5_000))
    assert found == [(1, False), (4, True)]


def test_an_entry_s_probe_is_the_one_its_lookup_computes(client: Client) -> None:
    """The probe PostgreSQL indexes (the expression of migration 0017, evaluated by the
    server on the written entries) is the one :func:`probes` computes for its own trigger
    time, and a window reaches the entries of every bucket it touches: a duplicate is
    found whichever side of a bucket's edge either task falls, and with a window of an
    hour (eight buckets)."""
    engine = client.store.engine
    edge = 1_800_000_000_000 >> PROBE_BUCKET_BITS << PROBE_BUCKET_BITS
    times = [edge - 1, edge, edge + 1, edge + 4_999, edge - 3_600_000, edge + 3_599_999]
    rows = [task_row(10 + i, t, fingerprint=f"{0xfedcba98 - i:08x}" + "0" * 24)
            for i, t in enumerate(times)]
    insert_tasks(engine, rows, 0)
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            indexed = dict(conn.execute(text(
                f"SELECT task_id, {PROBE_SQL.format(t='')} FROM ax_fingerprint")).all())
        for r in rows:
            assert probes(r["fingerprint"], r["trigger_time"], 1) == [indexed[r["task_id"]]]
    originals = [(r["task_id"], False) for r in rows]

    def moved(first_id: int, by: list[int]) -> list[dict[str, Any]]:
        return [{**r, "task_id": first_id + i, "trigger_time": r["trigger_time"] + d}
                for i, (r, d) in enumerate(zip(rows, by, strict=True))]

    # 4 s away, the first three across the edge
    assert _pairs(insert_tasks(engine, moved(100, [4_000, -4_000, -4_000, -4_000, 4_000, -4_000]),
                               5_000)) == originals
    later = [3_500_000] * len(rows)
    assert _pairs(insert_tasks(engine, moved(200, later), 3_600_000)) == originals  # an hour
    assert _pairs(insert_tasks(engine, moved(300, later), 5_000)) == [(300 + i, True)
                                                                      for i in range(len(rows))]


def _plan(conn: Any, statement: Any, params: dict[str, Any]) -> str:
    """PostgreSQL's plan for ``statement`` with ``params``, as ax sends it (the statement
    is prefixed with ``EXPLAIN`` on its way to the driver)."""
    def explain(_conn: Any, _cursor: Any, sql: str, parameters: Any, _context: Any,
                _many: bool) -> tuple[str, Any]:
        return "EXPLAIN " + sql, parameters

    event.listen(conn, "before_cursor_execute", explain, retval=True)
    try:
        return "\n".join(conn.execute(statement, params).scalars())
    finally:
        event.remove(conn, "before_cursor_execute", explain)


def test_the_duplicate_check_enters_its_indexes_by_their_keys(client: Client) -> None:
    """The lookups of an enqueue read a few pages per task, not a whole index: the
    fingerprints through the index of their probes; the biz keys through the unique index, by type
    and key together (with the biz key alone PostgreSQL read every entry of that index
    for each batch: 120 ms per 1,000 tasks at 1M rows, and growing; with the two as IN
    lists, a type the statistics did not know yet was read whole, every row of it fetched,
    for each batch). The schedulers' prune deletes the entries it chose by their addresses."""
    from ax_kombu.store.enqueue import _FIND_BIZ_PG, _FIND_FP_PG
    from ax_kombu.store.tasks import _PRUNE

    engine = client.store.engine
    if engine.dialect.name != "postgresql":
        pytest.skip("PostgreSQL's plans")
    with engine.begin() as conn:  # 20,000 tasks, one in five with a biz key
        conn.execute(text(
            "INSERT INTO ax_task (task_id, task_type, trigger_time, status, priority, "
            "retry_count, max_retry, timeout_ms, processor_name, payload, biz_key, fingerprint,"
            " trace_id, attempt, created_at, runner) SELECT i, 't' || (i % 7), 1000 + i, "
            "'SUCCESS', 'default', 0, 0, 1000, 't', '{}', CASE WHEN i % 5 = 0 THEN 'k' || i "
            "END, md5(i::text), 'x', 1, 1, 'ax' FROM generate_series(1, 20000) AS i"))
        conn.execute(text("INSERT INTO ax_fingerprint SELECT fingerprint, trigger_time, "
                          "task_id FROM ax_task"))
        conn.execute(text("ANALYZE ax_task, ax_fingerprint"))
        # a type the statistics do not know yet: 5,000 keyed rows written after ANALYZE
        conn.execute(text(
            "INSERT INTO ax_task (task_id, task_type, trigger_time, status, priority, "
            "retry_count, max_retry, timeout_ms, processor_name, payload, biz_key, fingerprint,"
            " trace_id, attempt, created_at, runner) SELECT i, 'fresh', 1000 + i, 'DELAYED', "
            "'default', 0, 0, 1000, 't', '{}', 'f' || i, md5(i::text), 'x', 0, 1, 'ax' "
            "FROM generate_series(100001, 105000) AS i"))
        keys = [f"k{i}" for i in range(5, 500, 5)]
        by_biz = _plan(conn, _FIND_BIZ_PG, {"types": ["t1"] * len(keys), "keys": keys})
        fresh = _plan(conn, _FIND_BIZ_PG, {"types": ["fresh"] * 100,
                                           "keys": [f"f{i}" for i in range(100001, 100101)]})
        fps = [f"{i:032x}" for i in range(100)]
        found = sorted({p for fp in fps for p in probes(fp, 20_000, 5_000)})
        by_fp = _plan(conn, _FIND_FP_PG, {"lo": 10_000, "hi": 30_000,
                                          "probes": "{" + ",".join(map(str, found)) + "}"})
        prune = _plan(conn, _PRUNE["postgresql"], {"created_before": 5000,
                                                   "trigger_before": 10**13, "limit": 100})
    assert "Seq Scan" not in by_biz and "Seq Scan" not in by_fp
    for plan in (by_biz, fresh):  # each pair one probe by both columns, never by type alone
        cond = next(line for line in plan.splitlines() if "Index Cond" in line)
        assert "task_type" in cond and "biz_key" in cond, plan
    assert "ix_ax_fingerprint_probe" in by_fp, by_fp
    # the prune deletes what it chose by address, not by a scan matching three columns
    assert "Tid Scan on ax_fingerprint" in prune and "Semi Join" not in prune
