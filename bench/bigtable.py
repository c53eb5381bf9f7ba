"""Issue 24: what ax's hot statements cost on a task table of N rows, against 10,000.

Two scratch PostgreSQL databases (``--rows``, then ``--small``; ax's migrations make the
schema) are filled on the server, measured through ax's own code, and dropped. The server
is, by default, one of the benchmark's own (``--server private``: ``initdb`` in a temporary
directory, configured as PostgreSQL's documentation advises for a dedicated server,
``shared_buffers`` a quarter of the memory, the rest at its defaults, autovacuum on; removed
afterwards); ``--server shared`` uses the one at ``AX_BENCH_PG_URL`` as it is configured.

* **The fill** (``INSERT … SELECT FROM generate_series``, chunks of 500,000 rows): tasks
  created over the past 28 days, oldest first, in task id order as producers write them.
  Of the newest fifth, half are DELAYED, due between 3 h and 5 days 3 h from now (10 % of
  the table); otherwise 6 % FAILED (three retries each, three ``ax_attempt`` rows), 5 %
  CANCELLED, the rest SUCCESS; the last 1,000 (or a tenth) finished in the five minutes
  before the fill. One task in five has a biz_key. An ``ax_fingerprint`` row is written
  for each task the schedulers' pruning keeps (created in the last day, or not yet due):
  a table pruned as it goes reuses the room of the entries it deletes (an earlier version
  wrote every entry and pruned 90 % of them at once, which left the key's index at ten
  times its size, as an upgrade does once: docs/deploy.md). Each task gets an ``ax_due``
  entry in the same order, and those whose task has moved on are then deleted, as the
  schedulers' pruning leaves the table: the entries of the tasks still due, among the room
  of the others. ``ax_task_archive`` gets as
  many finished tasks again (the 90 days before), with their ``ax_attempt_archive`` rows.
  Then ``VACUUM ANALYZE``, and a ``CHECKPOINT``: the fill's dirty pages (gigabytes at 10M)
  are written before the rounds, not by the checkpointer while they run.
* **enqueue**: ``Client.enqueue_many`` of ``--enqueue`` tasks in batches of
  ``--enqueue-batch`` (rows/s), due a day ahead, a batch within 17 minutes; as many again
  each due at its own time over five days (no two of a batch near each other: the duplicate
  check's probes of a batch then fall anywhere in its index); half as many each with a biz
  key of its own; and ``--single`` ``Client.enqueue`` calls (calls/s), due a day ahead.
* **preload, idle**: the housekeeper's preload round (``nodes.live_names`` +
  ``preload.preload``, one transaction, the ``Loaded`` carried from call to call as the
  scheduler carries it) with nothing due in its 10 s window, ``--idle-calls`` calls a round.
* **preload, busy**: ``--busy`` tasks enqueued due inside one 10 s window (20 minutes
  ahead), then the preload round that reads that window (all of them come back), as a
  scheduler makes it: read up to the window, as of a mark taken before the enqueue (so the
  tasks are also among what changed since); and the number of pages PostgreSQL put those
  tasks on, in ``ax_task`` and in ``ax_due`` (what the round reads), and the WAL their
  enqueue wrote (a page's first change after a checkpoint logs all of it).
* **claim**: those tasks claimed by ``claims.claim`` in batches of ``claim_batch`` on one
  autocommit connection, as the claimer does (its ``now`` is set past their trigger time,
  so nothing waits): rows/s.
* **ax status**: ``ax_kombu.cli.status._store_view`` (what ``ax status --no-broker``
  reads: a new engine, one connection), and each of its store reads timed apart on one
  connection, to say which one grows with the table.

Each measure but status is taken twice: by the wall clock, and by the CPU time the
database's backends used (:class:`Meter`; on a machine shared with other work the wall
clock of one round can be several times another's, the backends' CPU stays within a few
per cent). Every measure is repeated ``--rounds`` times, the rounds alternating between
the two tables, and reported as the median of the rounds. The tasks a measure enqueued
are deleted after it (with their fingerprints) and the tables vacuumed, so each round sees
the table at its size. Then one more pass runs the same calls with ``auto_explain``
(``log_analyze``, ``log_buffers``, ``log_wal``; its messages sent to this client as
notices, not to the server's log) to record the plans of the preload, enqueue, claim and
status statements as ax sends them, and the buffers they touched.

Printed: measure, the small table's median, N's, the cost ratio (N's cost over the small
table's: time per call, or the inverse of a rate; above 1.2 is flagged) and that ratio
for the best rounds; the buffers, WAL and time of each group of plans; the plans.
Everything also goes to ``bench/results/bigtable-<N>-<UTC>.json`` and ``.md``.

    .venv/bin/python -m bench.bigtable --rows 10000000 [--small 10000] [--rounds 5]
        [--enqueue 20000] [--enqueue-batch 1000] [--single 300] [--idle-calls 200]
        [--busy 10000] [--status-calls 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine, event, text

from ax_kombu.api import Client
from ax_kombu.cli.status import DELAY_WINDOW_MS, _store_view
from ax_kombu.config import PRIORITIES, Settings, from_env
from ax_kombu.core.ids import EPOCH_MS, compose
from ax_kombu.store import gates, nodes, preload, recovery
from ax_kombu.store.claims import claim
from ax_kombu.store.console import tasks_by_status
from ax_kombu.store.engine import db_now_ms, make_engine
from ax_kombu.store.enqueue import insert_tasks
from ax_kombu.store.stats import schedule_delays
from ax_kombu.store.tasks import forget_fingerprints
from ax_kombu.validation import build_row

from .common import PG_ADMIN, machine, private_server, scratch_database, wait_quiet

RESULTS = Path(__file__).with_name("results")
NODE = "bigtable-bench"
DAY_MS = 86_400_000
CHUNK = 500_000
#: above this cost ratio (N against the small table) a measure is flagged
LIMIT = 1.2

# -- the fill -------------------------------------------------------------------------------------

# One chunk [a, b) of a fill: the rows as ``f``, one per task, with ax_task's columns. Row i
# is created at :start + i·:spread/:m (i < :m), or in the three minutes before :recent_to (the
# last ones); from row :future_from on, one in two (by the hash h) is DELAYED. All times are
# epoch ms.
_ROWS = """
WITH g AS (
    SELECT i, abs(hashint8extended(i, 7) % 1000) AS h, abs(hashint8extended(i, 11)) AS r,
           CASE WHEN i < :m THEN :start + (i * :spread) / :m
                ELSE :recent_to - 180000 + ((i - :m) * 180000) / GREATEST(1, :n - :m) END
               AS created
      FROM generate_series(CAST(:a AS BIGINT), CAST(:b AS BIGINT) - 1) AS i),
s AS (
    SELECT g.*, 'big.t' || (i % 20) AS tt,
           '{"coupon":"SPRING' || (i % 97) || '","order":' || i || ',"user":'
               || (i % 100003) || '}' AS body,
           CASE WHEN i >= :m THEN 'SUCCESS'
                WHEN i >= :future_from AND h < 500 THEN 'DELAYED'
                WHEN h >= 940 THEN 'FAILED'
                WHEN h >= 890 THEN 'CANCELLED'
                ELSE 'SUCCESS' END AS st
      FROM g),
t AS (
    SELECT s.*, CASE st WHEN 'DELAYED' THEN :future_start + r % :future_span
                        WHEN 'CANCELLED' THEN created + r % 3600000
                        ELSE created + r % 60000 END AS due
      FROM s),
u AS (
    SELECT t.*, CASE WHEN st IN ('SUCCESS', 'FAILED') THEN due + r % 20 END AS sent
      FROM t),
f AS (
    SELECT ((created - {epoch}) << 22) | (i & 4194303) AS task_id, tt AS task_type,
           due AS trigger_time, st AS status,
           CASE r % 10 WHEN 0 THEN 'high' WHEN 1 THEN 'slow' ELSE 'default' END AS priority,
           CASE st WHEN 'FAILED' THEN 3 ELSE 0 END AS retry_count, 3 AS max_retry,
           60000 AS timeout_ms, tt AS processor_name, body AS payload,
           CASE WHEN r % 5 = 0 THEN 'order-' || i END AS biz_key,
           md5(tt || ':' || body) AS fingerprint, md5(i || '-trace') AS trace_id,
           CASE st WHEN 'FAILED' THEN 4 WHEN 'SUCCESS' THEN 1 ELSE 0 END AS attempt,
           CASE WHEN sent IS NOT NULL THEN 'worker-' || (i % 8) END AS owner_node,
           created AS created_at, sent AS dispatched_at, sent + 3 AS started_at,
           CASE WHEN sent IS NOT NULL THEN sent + 3 + r % 5000
                WHEN st = 'CANCELLED' THEN created + (due - created) / 2 END AS finished_at,
           CASE st WHEN 'FAILED' THEN 'RuntimeError: upstream answered 503' END AS last_error,
           0 AS redispatches, false AS gated, 'ax' AS runner
      FROM u)
""".replace("{epoch}", str(EPOCH_MS))

_COLUMNS = ("task_id, task_type, trigger_time, status, priority, retry_count, max_retry, "
            "timeout_ms, processor_name, payload, biz_key, fingerprint, trace_id, attempt, "
            "owner_node, created_at, dispatched_at, started_at, finished_at, last_error, "
            "redispatches, gated, runner")
#: the hot table, and from the rows it returns an ``ax_fingerprint`` row for each task the
#: schedulers' pruning keeps (:func:`kept_fingerprints`) and an ``ax_due`` entry for each
#: task (its trigger keeps the claimable ones' entries, off during the fill: :func:`fill`)
_HOT = _ROWS + (
    ", ins AS (INSERT INTO ax_task (" + _COLUMNS + ") SELECT " + _COLUMNS
    + " FROM f RETURNING fingerprint, trigger_time, task_id, runner), "
    "fp AS (INSERT INTO ax_fingerprint SELECT fingerprint, trigger_time, task_id FROM ins "
    "WHERE task_id >= :fp_kept_id OR trigger_time >= :fp_due_from) "
    "INSERT INTO ax_due (task_id, trigger_time, runner, armed) "
    "SELECT task_id, trigger_time, runner, 0 FROM ins")
#: what the schedulers' pruning of ``ax_due`` leaves (:func:`preload.prune_due`, in one
#: statement): the entries of tasks still due at their time
_PRUNED_DUE = f"DELETE FROM ax_due AS d WHERE NOT {preload._STILL_DUE}"
#: the archive table: written by ``ax archive``, the final rows as they are
_COLD = _ROWS + "INSERT INTO ax_task_archive (" + _COLUMNS + ") SELECT " + _COLUMNS + " FROM f"

_ATTEMPTS = """
INSERT INTO {target} (task_id, attempt, task_type, node, trigger_time, dispatched_at,
                      started_at, finished_at, outcome, error, duration_ms)
SELECT task_id, k, task_type, owner_node, trigger_time, dispatched_at - (4 - k) * 60000,
       started_at - (4 - k) * 60000, finished_at - (4 - k) * 60000, 'RETRY', last_error,
       finished_at - started_at
  FROM {source} CROSS JOIN generate_series(1, 3) AS k WHERE status = 'FAILED'"""

_TABLES = ("ax_task", "ax_fingerprint", "ax_due", "ax_attempt", "ax_task_archive",
           "ax_attempt_archive")


def fill(engine: Engine, n: int) -> dict[str, Any]:
    """Fill the hot and the archive tables with ``n`` tasks each (see the module docstring),
    then ``VACUUM ANALYZE``; returns the seconds each step took and the sizes."""
    took: dict[str, float] = {}
    with engine.connect() as conn:
        t0 = db_now_ms(conn)
    recent = min(1000, max(1, n // 10))
    hot = {"n": n, "m": n - recent, "start": t0 - 28 * DAY_MS, "spread": 28 * DAY_MS - 600_000,
           "recent_to": t0 - 60_000, "future_from": (n - recent) * 4 // 5,
           "future_start": t0 + 3 * 3_600_000, "future_span": 5 * DAY_MS}
    cold = {**hot, "m": n, "start": t0 - 118 * DAY_MS, "spread": 90 * DAY_MS, "future_from": n}
    hot.update(kept_fingerprints(t0))
    # every task had its ax_due entry, in the order tasks were made; the pruning has since
    # deleted those whose task moved on, leaving their room for the next ones
    _timed_sql(engine, "ALTER TABLE ax_task DISABLE TRIGGER ax_due_insert")
    for name, sql, params in (("ax_task + ax_fingerprint + ax_due", _HOT, hot),
                              ("ax_task_archive", _COLD, cold)):
        took[name] = _chunked(engine, sql, params, n, name)
    _timed_sql(engine, "ALTER TABLE ax_task ENABLE TRIGGER ax_due_insert")
    took["ax_due pruned"] = _timed_sql(engine, _PRUNED_DUE)
    for target, source in (("ax_attempt", "ax_task"), ("ax_attempt_archive", "ax_task_archive")):
        took[target] = _timed_sql(engine, _ATTEMPTS.format(target=target, source=source))
    took["VACUUM ANALYZE"] = _timed_sql(engine, "VACUUM ANALYZE", autocommit=True)
    # the fill and the VACUUM leave gigabytes of dirty pages at 10M; written out now, not
    # by the checkpointer while the rounds run (a table grown over weeks has no such debt)
    took["CHECKPOINT"] = _timed_sql(engine, "CHECKPOINT", autocommit=True)
    return {"t0": t0, "seconds": took, "sizes": sizes(engine)}


def kept_fingerprints(now_ms: int) -> dict[str, int]:
    """Which tasks of the fill have an ``ax_fingerprint`` entry: those the schedulers'
    continuous pruning keeps (:func:`ax_kombu.store.tasks.prune_fingerprints` with the
    default ``fingerprint_retention_s`` and dedup window), created in the last day or not
    yet due. Only they are written: a table pruned as it goes reuses the room its deleted
    entries leave, while writing every entry and pruning 90 % of them at once would leave
    the key's index at ten times its size (an upgrade does that once: docs/deploy.md)."""
    settings = Settings()
    return {"fp_kept_id": compose(now_ms - int(settings.fingerprint_retention_s * 1000), 0, 0),
            "fp_due_from": now_ms - settings.dedup_window_ms}


def _chunked(engine: Engine, sql: str, params: dict[str, Any], n: int, name: str) -> float:
    started = time.monotonic()
    for a in range(0, n, CHUNK):
        with engine.begin() as conn:
            conn.execute(text(sql), {**params, "a": a, "b": min(n, a + CHUNK)})
        print(f"    {name}: {min(n, a + CHUNK):,} of {n:,} rows, "
              f"{time.monotonic() - started:.0f} s", flush=True)
    return time.monotonic() - started


def _timed_sql(engine: Engine, sql: str, autocommit: bool = False) -> float:
    started = time.monotonic()
    with engine.connect() as conn:
        if autocommit:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(text(sql))
        conn.commit()
    return time.monotonic() - started


def sizes(engine: Engine) -> dict[str, Any]:
    """Rows (estimated) and bytes (with indexes and TOAST) of ax's tables, per index, and
    the database's size."""
    with engine.connect() as conn:
        tables = {r[0]: {"rows": int(r[1]), "bytes": int(r[2])} for r in conn.execute(text(
            "SELECT relname, reltuples, pg_total_relation_size(oid) FROM pg_class "
            "WHERE relkind = 'r' AND relname = ANY(:t)"), {"t": list(_TABLES)})}
        indexes = {r[0]: int(r[1]) for r in conn.execute(text(
            "SELECT indexrelname, pg_relation_size(indexrelid) FROM pg_stat_user_indexes "
            "WHERE relname IN ('ax_task', 'ax_fingerprint', 'ax_due')"))}
        total = int(conn.execute(text("SELECT pg_database_size(current_database())"))
                    .scalar_one())
    return {"tables": tables, "indexes": indexes, "database_bytes": total}


# -- the measures ---------------------------------------------------------------------------------

def remove(engine: Engine, ids: Sequence[int]) -> None:
    """Delete the tasks ``ids`` and their fingerprints, as ``ax archive`` does, and their
    ``ax_due`` entries, as the schedulers' pruning does once their time has passed; vacuum."""
    with engine.begin() as conn:
        gone = conn.execute(text("DELETE FROM ax_task WHERE task_id = ANY(:ids) "
                                 "RETURNING task_id, fingerprint"), {"ids": list(ids)})
        forget_fingerprints(conn, [(r[0], r[1]) for r in gone])
        conn.execute(text("DELETE FROM ax_due WHERE task_id = ANY(:ids)"), {"ids": list(ids)})
    _timed_sql(engine, "VACUUM ax_task, ax_fingerprint, ax_due", autocommit=True)


def enqueue_items(tag: str, count: int, at: Callable[[int], dict[str, Any]]
                  ) -> list[dict[str, Any]]:
    return [{"task_type": "bench.big", "payload": {"tag": tag, "i": i}, **at(i)}
            for i in range(count)]


def enqueue_many(client: Client, tag: str, total: int, batch: int, keyed: bool = False,
                 spread: bool = False) -> list[int]:
    """``total`` tasks by ``enqueue_many`` in batches of ``batch``, due a day ahead, a batch
    of 1,000 within 17 minutes (or, if ``spread``, each at its own time in the five days
    from 3 h ahead, where the fill's future tasks are); each with a biz key of its own (the
    idempotent enqueue) if ``keyed``."""
    def at(i: int) -> dict[str, Any]:
        delay = 10_800 + i * 2_654_435_761 % 432_000 if spread else 86_400 + i % 3600
        return {"delay": delay, **({"biz_key": f"{tag}-{i}"} if keyed else {})}

    items = enqueue_items(tag, total, at)
    return [int(t) for a in range(0, total, batch) for t in client.enqueue_many(items[a:a + batch])]


def enqueue_single(client: Client, tag: str, count: int) -> list[int]:
    """``count`` single ``enqueue`` calls, due a day ahead."""
    return [int(client.enqueue("bench.single", {"tag": tag, "i": i}, delay=86_400 + i))
            for i in range(count)]


def preload_round(engine: Engine, settings: Settings, loaded: preload.Loaded,
                  horizon_ms: int, now_ms: int) -> tuple[list[tuple[int, int]], preload.Loaded]:
    """One preload round as the housekeeper makes it (its ``_preload``), on ``engine``."""
    with engine.begin() as conn:
        live = nodes.live_names(conn, "scheduler", now_ms - settings.silence_ms)
        share = preload.Share.among(live, NODE)
        return preload.preload(conn, loaded, horizon_ms, settings.preload_batch, share,
                                settings.claim_lead_ms)


def idle_preloads(client: Client, calls: int) -> None:
    """``calls`` preload rounds with nothing in the window, each from where the last one
    stopped (after a first full read, made before)."""
    store, settings = client.store, client.settings
    now = store.now_ms()
    _, loaded = preload_round(store.engine, settings, preload.Loaded(),
                              now + settings.preload_window_ms, now)
    for _ in range(calls):
        now = store.now_ms()
        rows, loaded = preload_round(store.engine, settings, loaded,
                                     now + settings.preload_window_ms, now)
        if rows:
            raise RuntimeError(f"the idle preload found {len(rows)} task(s) in its window")


def enqueue_window(client: Client, tag: str, count: int, lo_ms: int) -> list[int]:
    """``count`` tasks due in ``[lo_ms, lo_ms + preload_window_ms)``, enqueued in batches
    of 1,000; their ids."""
    span = client.settings.preload_window_ms
    items = enqueue_items(tag, count, lambda i: {"run_at": datetime.fromtimestamp(
        (lo_ms + i * span // count) / 1000, UTC)})
    return [t for a in range(0, count, 1000) for t in client.enqueue_many(items[a:a + 1000])]


def busy_preload(engine: Engine, settings: Settings, loaded: preload.Loaded, expect: int
                 ) -> list[tuple[int, int]]:
    """The preload round that reads the window from ``loaded.until`` (the scheduler's
    state: read up to there, as of a mark taken before the tasks were enqueued, so they are
    also among what changed since); checks it found ``expect`` tasks."""
    lo_ms = loaded.until
    rows, _ = preload_round(engine, settings, loaded, lo_ms + settings.preload_window_ms,
                            lo_ms)
    if len(rows) != expect:
        raise RuntimeError(f"the busy preload read {len(rows)} task(s), not {expect}")
    return rows


def claim_all(engine: Engine, settings: Settings, rows: list[tuple[int, int]], now_ms: int,
              batches: int | None = None) -> int:
    """Claim ``rows`` (by fire time) in batches of ``claim_batch`` on one autocommit
    connection, as the claimer does; returns how many were claimed."""
    ids = [t for t, _ in sorted(rows, key=lambda r: r[1])]
    step = settings.claim_batch
    claimed = 0
    with engine.connect() as plain:
        conn = plain.execution_options(isolation_level="AUTOCOMMIT")
        for k, a in enumerate(range(0, len(ids), step)):
            if batches is not None and k >= batches:
                break
            claimed += len(claim(conn, ids[a:a + step], NODE, now_ms + k,
                                 now_ms + k + settings.claim_lead_ms))
    return claimed


def busy_round(t: Filled, tag: str, count: int, lo_ms: int, calls: int = 3
               ) -> dict[str, float]:
    """Enqueue ``count`` tasks due in one window; measure the preload that reads them
    (median of ``calls``) and the claim of all of them; remove them."""
    engine, settings = t.client.store.engine, t.client.settings
    with engine.connect() as conn:
        before = conn.execute(text("SELECT pg_current_wal_lsn()")).scalar_one()
        loaded = preload.Loaded(lo_ms, preload.read_mark(conn))
    ids = enqueue_window(t.client, tag, count, lo_ms)
    with engine.connect() as conn:  # where PostgreSQL put them and their ax_due entries
        pages, due_pages = (conn.execute(text(
            f"SELECT count(DISTINCT (ctid::text::point)[0]) FROM {table} "
            "WHERE task_id = ANY(:ids)"), {"ids": ids}).scalar_one()
            for table in ("ax_task", "ax_due"))
        wal = conn.execute(text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), :lsn)"),
                           {"lsn": before}).scalar_one()
    reads = []
    for _ in range(calls):
        with t.meter.span() as read:
            rows = busy_preload(engine, settings, loaded, count)
        reads.append(read)
    with t.meter.span() as claimed:
        got = claim_all(engine, settings, rows, lo_ms + settings.preload_window_ms)
    if got != count:
        raise RuntimeError(f"claimed {got} of {count} due tasks")
    remove(engine, ids)
    return {"preload busy: heap pages of the window's tasks": float(pages),
            "preload busy: pages of their ax_due entries": float(due_pages),
            "preload busy: WAL of their enqueue, MB": float(wal) / 2**20,
            "preload busy ms/call": statistics.median(r.wall for r in reads) * 1000,
            "preload busy, PG CPU ms/call": statistics.median(r.cpu for r in reads) * 1000,
            "claim rows/s": count / claimed.wall,
            "claim, PG CPU µs/row": claimed.cpu / count * 1e6}


def status_reads(settings: Settings) -> list[tuple[str, Callable[[Connection, int], Any]]]:
    """The store reads of ``ax status`` (:func:`ax_kombu.cli.status._store_view`), in its
    order, by name; each called with a connection and the database's time."""
    return [
        ("live nodes", lambda c, now: nodes.live_nodes(c, settings.silence_ms)),
        ("tasks by status", lambda c, now: tasks_by_status(c)),
        ("waiting without consumer",
         lambda c, now: recovery.waiting_without_consumer(c, PRIORITIES)),
        ("parked by type", lambda c, now: gates.parked_by_type(c)),
        ("limits", lambda c, now: gates.list_limits(c)),
        ("oldest overdue", lambda c, now: recovery.oldest_overdue_ms(c, now)),
        ("schedule delays (5 min)", lambda c, now: schedule_delays(c, now - DELAY_WINDOW_MS)),
    ]


def status_parts_ms(engine: Engine, settings: Settings, calls: int = 1) -> dict[str, float]:
    """Milliseconds of each of ``ax status``'s store reads on one connection (the median of
    ``calls``)."""
    took: dict[str, list[float]] = {}
    with engine.connect() as conn:
        for _ in range(calls):
            now = db_now_ms(conn)
            for name, read in status_reads(settings):
                started = time.perf_counter()
                read(conn, now)
                took.setdefault(name, []).append((time.perf_counter() - started) * 1000)
            conn.rollback()
    return {name: statistics.median(values) for name, values in took.items()}


def status_ms(settings: Settings, calls: int) -> float:
    """Median milliseconds of ``ax status``'s store view (a new engine each call)."""
    took = []
    for _ in range(calls):
        started = time.perf_counter()
        _store_view(settings)
        took.append((time.perf_counter() - started) * 1000)
    return statistics.median(took)


# -- plans ----------------------------------------------------------------------------------------

_AUTO_EXPLAIN = ("LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
                 "SET auto_explain.log_analyze = on", "SET auto_explain.log_buffers = on",
                 "SET auto_explain.log_timing = on", "SET auto_explain.log_wal = on",
                 "SET auto_explain.log_level = notice",
                 "SET client_min_messages = notice")
#: where SQLAlchemy's psycopg2 dialect logs the notices it receives
_NOTICES = logging.getLogger("sqlalchemy.dialects.postgresql")


class Explained(logging.Handler):
    """An engine whose connections send ``EXPLAIN (ANALYZE, BUFFERS)`` of each statement
    to this client (``auto_explain`` at NOTICE level: not written to the server's log).
    SQLAlchemy's psycopg2 dialect logs every notice it receives (and empties psycopg2's
    list): they are collected from that log while this is open."""

    def __init__(self, url: str) -> None:
        super().__init__(logging.INFO)
        self.engine = make_engine(url, pool_size=1)
        event.listen(self.engine, "connect", self._setup)
        self._found: list[str] = []
        self._saved = (_NOTICES.level, _NOTICES.propagate)
        _NOTICES.setLevel(logging.INFO)
        _NOTICES.propagate = False
        _NOTICES.addHandler(self)

    @staticmethod
    def _setup(dbapi_conn: Any, _record: Any) -> None:
        cursor = dbapi_conn.cursor()
        for statement in _AUTO_EXPLAIN:
            cursor.execute(statement)
        cursor.close()
        dbapi_conn.commit()  # the SETs outlive this transaction

    def emit(self, record: logging.LogRecord) -> None:
        self._found.append(record.getMessage())

    def take(self) -> list[str]:
        """The plans logged since the last call, of statements on ax's tables."""
        found, self._found = [_tidy(m) for m in self._found], []
        return [p for p in found if "ax_" in p]

    def close(self) -> None:
        _NOTICES.removeHandler(self)
        _NOTICES.setLevel(self._saved[0])
        _NOTICES.propagate = self._saved[1]
        self.engine.dispose()
        super().close()


def _tidy(notice: str) -> str:
    """A plan notice without its prefix, each line cut to 400 characters (the claim's
    id array)."""
    lines = notice.removeprefix("NOTICE:  ").rstrip().split("\n")
    return "\n".join(line[:400] + (" …" if len(line) > 400 else "") for line in lines)


def plans(url: str, client: Client, lo_ms: int, busy: int) -> dict[str, list[str]]:
    """The plans of one preload round (idle, then busy), one enqueue batch, the first claim
    batch and ``ax status``'s reads, as ax runs them."""
    settings = client.settings
    ex = Explained(url)
    out: dict[str, list[str]] = {}
    try:
        now = client.store.now_ms()
        _, loaded = preload_round(ex.engine, settings, preload.Loaded(),
                                  now + settings.preload_window_ms, now)
        ex.take()
        now = client.store.now_ms()
        preload_round(ex.engine, settings, loaded, now + settings.preload_window_ms, now)
        out["preload, idle"] = ex.take()
        for what, count, batch, keyed in (
                ("enqueue (a batch of 1,000)", 1000, 1000, False),
                ("enqueue with biz keys (a batch of 1,000)", 1000, 1000, True),
                ("enqueue (20 single calls)", 20, 1, False)):
            out[what], ids = explain_enqueue(ex, client, count, batch, keyed)
            remove(client.store.engine, ids)
        with ex.engine.connect() as conn:
            loaded = preload.Loaded(lo_ms, preload.read_mark(conn))
        ids = enqueue_window(client, "plans", busy, lo_ms)
        rows = busy_preload(ex.engine, settings, loaded, busy)
        out["preload, busy"] = ex.take()
        claim_all(ex.engine, settings, rows, lo_ms + settings.preload_window_ms, batches=1)
        out["claim (a batch)"] = ex.take()
        remove(client.store.engine, ids)
        status_parts_ms(ex.engine, settings)
        out["ax status"] = ex.take()
    finally:
        ex.close()
    return out


def explain_enqueue(ex: Explained, client: Client, count: int, batch: int, keyed: bool
                    ) -> tuple[list[str], list[int]]:
    """``count`` tasks enqueued ``batch`` at a time through ``ex`` (Client's own steps:
    rows built and validated, ids leased, ``insert_tasks``), each with a biz key of its
    own if ``keyed``; their plans and ids."""
    settings = client.settings
    now = client.store.now_ms()
    tag = f"plans{batch}{'k' if keyed else ''}"
    rows = [build_row(settings, now, "bench.big", {"tag": tag, "i": i}, delay=86_400 + i,
                      biz_key=f"{tag}-{i}" if keyed else None) for i in range(count)]
    for row, task_id in zip(rows, client.ids.next_ids(len(rows)), strict=True):
        row["task_id"] = task_id
    for a in range(0, count, batch):
        insert_tasks(ex.engine, rows[a:a + batch], settings.dedup_window_ms,
                     wake_before_ms=now + settings.preload_window_ms)
    return ex.take(), [r["task_id"] for r in rows]


@dataclass
class Span:
    """What one measured stretch took: wall seconds, and CPU seconds of the database's
    backends."""

    wall: float = 0.0
    cpu: float = 0.0


class Meter:
    """Measures a stretch by the wall clock and by the CPU the scratch database's backends
    used (``/proc/<pid>/schedstat``, in ns: what the statements cost PostgreSQL, much less
    disturbed by the machine's other load than the wall clock). Connections opened and
    closed inside the stretch, and parallel workers, are not counted: the measures that
    use it keep their connections (the client's pool, the claimer's connection)."""

    def __init__(self, url: str) -> None:
        self._engine = make_engine(url, pool_size=1, isolation_level="AUTOCOMMIT")

    def _cpu(self) -> dict[int, float]:
        with self._engine.connect() as conn:
            pids = list(conn.execute(text(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND backend_type = 'client backend' AND pid <> pg_backend_pid()")).scalars())
        return {pid: _run_s(pid) for pid in pids}

    @contextmanager
    def span(self) -> Iterator[Span]:
        span = Span()
        before = self._cpu()
        started = time.perf_counter()
        yield span
        span.wall = time.perf_counter() - started
        span.cpu = sum(s - before.get(pid, 0.0) for pid, s in self._cpu().items())

    def close(self) -> None:
        self._engine.dispose()


def _run_s(pid: int) -> float:
    """Seconds process ``pid`` has run on a CPU (0.0 when gone)."""
    try:
        with open(f"/proc/{pid}/schedstat") as stat:
            return int(stat.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


# -- the rounds -----------------------------------------------------------------------------------

class Filled(NamedTuple):
    """One scratch database filled with ``rows`` tasks, and a producer's client on it."""

    rows: int
    url: str
    client: Client
    meter: Meter
    fill: dict[str, Any]


@contextmanager
def filled(n: int, admin_url: str) -> Iterator[Filled]:
    """A scratch database with ``n`` tasks (see :func:`fill`) on the server of
    ``admin_url``, dropped afterwards."""
    name = f"ax_bench_bigtable_{os.getpid()}_{n}"
    print(f"{n:,} rows: filling {name}", flush=True)
    with scratch_database(name, admin_url=admin_url) as url:
        engine = make_engine(url)
        client = Client(from_env({}, database_url=url))
        try:
            done = fill(engine, n)
            print(f"  filled in {sum(done['seconds'].values()):.0f} s; database "
                  f"{done['sizes']['database_bytes'] / 2**20:,.0f} MB", flush=True)
            meter = Meter(url)
            yield Filled(n, url, client, meter, done)
            meter.close()
        finally:
            client.close()
            engine.dispose()


def warm_up(t: Filled) -> None:
    """A first enqueue (the id lease, the pool's connections) and preload, not measured."""
    ids = enqueue_many(t.client, "warm", 1000, 1000) + enqueue_single(t.client, "warm", 20)
    remove(t.client.store.engine, ids)
    idle_preloads(t.client, 5)


def one_round(t: Filled, r: int, args: argparse.Namespace) -> dict[str, float]:
    """Round ``r`` of every measure on ``t``; the tasks it enqueued are removed."""
    client = t.client
    engine, settings = client.store.engine, client.settings
    with t.meter.span() as many:
        ids = enqueue_many(client, f"r{r}", args.enqueue, args.enqueue_batch)
    remove(engine, ids)
    with t.meter.span() as spread:
        ids = enqueue_many(client, f"w{r}", args.enqueue, args.enqueue_batch, spread=True)
    remove(engine, ids)
    with t.meter.span() as keyed:
        ids = enqueue_many(client, f"k{r}", args.enqueue // 2, args.enqueue_batch, keyed=True)
    remove(engine, ids)
    with t.meter.span() as single:
        ids = enqueue_single(client, f"s{r}", args.single)
    remove(engine, ids)
    with t.meter.span() as idle:
        idle_preloads(client, args.idle_calls)
    got = {"enqueue_many rows/s": args.enqueue / many.wall,
           "enqueue_many, PG CPU µs/task": many.cpu / args.enqueue * 1e6,
           "enqueue_many, due over 5 days rows/s": args.enqueue / spread.wall,
           "enqueue_many, due over 5 days, PG CPU µs/task": spread.cpu / args.enqueue * 1e6,
           "enqueue_many with biz keys rows/s": args.enqueue // 2 / keyed.wall,
           "enqueue_many with biz keys, PG CPU µs/task": keyed.cpu / (args.enqueue // 2) * 1e6,
           "single enqueue calls/s": args.single / single.wall,
           "single enqueue, PG CPU µs/call": single.cpu / args.single * 1e6,
           "preload idle ms/call": idle.wall / args.idle_calls * 1000,
           "preload idle, PG CPU µs/call": idle.cpu / args.idle_calls * 1e6,
           **busy_round(t, f"b{r}", args.busy, client.store.now_ms() + (20 + r) * 60_000),
           "ax status ms": status_ms(settings, args.status_calls)}
    parts = status_parts_ms(engine, settings, args.status_calls)
    got.update({f"ax status: {k}": v for k, v in parts.items()})
    return got


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Fill both tables (the big one first: the small one's fill is short, so their recent
    history is as old at both), run the rounds alternately on them (the machine's drift
    then falls on both alike), record the plans; the figures of each size, small first."""
    with ExitStack() as stack:
        admin = stack.enter_context(private_server()) if args.server == "private" else PG_ADMIN
        server = server_settings(admin)
        print(f"server: {server}", flush=True)
        tables = [stack.enter_context(filled(n, admin)) for n in (args.rows, args.small)][::-1]
        for t in tables:
            warm_up(t)
        rounds: list[list[dict[str, float]]] = [[] for _ in tables]
        for r in range(args.rounds):
            for t, done in zip(tables, rounds, strict=True):
                done.append(one_round(t, r, args))
            print(f"  round {r + 1} of {args.rounds} done", flush=True)
        return [{"rows": t.rows, **t.fill, "server": server, "measures": _medians(done),
                 "plans": plans(t.url, t.client, t.client.store.now_ms() + 30 * 60_000,
                                args.busy)}
                for t, done in zip(tables, rounds, strict=True)]


#: which server the report names, by ``--server``
SERVERS = {"private": "the benchmark's own server", "shared": PG_ADMIN}
#: the server settings the report states
SERVER_SETTINGS = ("server_version", "shared_buffers", "effective_cache_size", "work_mem",
                   "autovacuum", "jit", "max_wal_size")


def server_settings(admin_url: str) -> dict[str, str]:
    """The server's :data:`SERVER_SETTINGS` as configured (``jit``: before ax's
    connection turned it off)."""
    engine = make_engine(admin_url, pool_size=1)
    try:
        with engine.connect() as conn:
            return {k: str(conn.execute(text(f"SHOW {k}")).scalar_one()) if k != "jit" else
                    str(conn.execute(text("SELECT reset_val FROM pg_settings "
                                          "WHERE name = 'jit'")).scalar_one())
                    for k in SERVER_SETTINGS}
    finally:
        engine.dispose()


def _medians(rounds: list[dict[str, float]]) -> dict[str, dict[str, Any]]:
    return {k: {"median": statistics.median(r[k] for r in rounds),
                "rounds": [r[k] for r in rounds]} for k in rounds[0]}


# -- the report -----------------------------------------------------------------------------------

#: the measures that are rates: their cost ratio is the small table's over N's
RATES = ("enqueue_many rows/s", "enqueue_many, due over 5 days rows/s",
         "enqueue_many with biz keys rows/s", "single enqueue calls/s",
         "claim rows/s")


def table(small: dict[str, Any], big: dict[str, Any]) -> list[str]:
    """The figures as a markdown table: measure, small, big (medians), the cost ratio of
    the medians (flagged above :data:`LIMIT`) and of the best rounds (the least disturbed
    by the machine's other load). Rates are marked in :data:`RATES`, the rest are times."""
    a, b = f"{small['rows']:,}", f"{big['rows']:,}"
    out = [f"| measure | {a} rows | {b} rows | cost ratio | best rounds |",
           "|---|---:|---:|---:|---:|"]
    for name, got in small["measures"].items():
        other = big["measures"][name]
        rate = name in RATES
        ratio = _ratio(got["median"], other["median"], rate)
        pick = max if rate else min
        best = _ratio(pick(got["rounds"]), pick(other["rounds"]), rate)
        flag = f" **> {LIMIT}**" if ratio > LIMIT else ""
        shown = f"  {name}" if name.startswith("ax status: ") else name
        out.append(f"| {shown} | {_fmt(got['median'])} | {_fmt(other['median'])} | "
                   f"{ratio:.2f}{flag} | {best:.2f} |")
    return out


def _ratio(small: float, big: float, rate: bool) -> float:
    """N's cost over the small table's."""
    if min(small, big) <= 0:
        return float("nan")
    return small / big if rate else big / small


def work_table(small: dict[str, Any], big: dict[str, Any]) -> list[str]:
    """Per group of plans: the shared buffers their statements touched (hit + read: the
    work, whatever else the machine does), the WAL they wrote, and their time, as
    auto_explain measured them (a COPY is not a plan: enqueue_many's writes are not in)."""
    a, b = f"{small['rows']:,}", f"{big['rows']:,}"
    out = [(f"| plans of | buffers at {a} | at {b} | ratio | WAL kB at {a} | at {b} "
           f"| ms at {a} | at {b} |"), "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for what, found in small["plans"].items():
        x, y = _work(found), _work(big["plans"][what])
        out.append(f"| {what} | {x[0]:,} | {y[0]:,} | {y[0] / max(1, x[0]):.2f} | "
                   f"{x[1] / 1024:,.1f} | {y[1] / 1024:,.1f} | {x[2]:.2f} | {y[2]:.2f} |")
    return out


def _work(plans: list[str]) -> tuple[int, int, float]:
    """Shared buffers (hit + read), WAL bytes and milliseconds of ``plans``, each read
    from its top node (its first ``Buffers:`` and ``WAL:`` lines, the ``duration:``)."""
    buffers, wal, took = 0, 0, 0.0
    for plan in plans:
        took += float(plan.split("duration: ", 1)[1].split(" ", 1)[0])
        buffers += _counter(plan, "Buffers:", ("hit", "read"))
        wal += _counter(plan, "WAL:", ("bytes",))
    return buffers, wal, took


def _counter(plan: str, label: str, keys: Sequence[str]) -> int:
    """The sum of ``keys`` (``hit=12``) on the first ``label`` line of ``plan``."""
    line = next((ln for ln in plan.splitlines() if ln.strip().startswith(label)), "")
    return sum(int(line.split(f"{k}=", 1)[1].split()[0]) for k in keys if f" {k}=" in line)


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def size_lines(result: dict[str, Any]) -> list[str]:
    s = result["sizes"]
    tables = ", ".join(f"{k} {v['rows']:,} rows {v['bytes'] / 2**20:,.0f} MB"
                       for k, v in sorted(s["tables"].items()))
    indexes = ", ".join(f"{k} {v / 2**20:,.1f} MB" for k, v in sorted(s["indexes"].items()))
    fill = ", ".join(f"{k} {v:.1f} s" for k, v in result["seconds"].items())
    return [(f"- {result['rows']:,} rows: database {s['database_bytes'] / 2**20:,.0f} MB; "
            f"fill {fill}"), f"  - tables: {tables}", f"  - indexes: {indexes}"]


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    small, big = results
    out = [f"# bench.bigtable: {small['rows']:,} against {big['rows']:,} rows",
           "", (f"{machine()}; medians of {args.rounds} rounds; "
           f"UTC {datetime.now(UTC):%Y-%m-%d %H:%M}"), "",
           f"PostgreSQL ({SERVERS[args.server]}): "
           + ", ".join(f"{k} {v}" for k, v in small["server"].items())
           + " (jit: ax turns it off on its connections)", "", *table(small, big), "",
           "Work of the plans below (one call each):", "", *work_table(small, big), "",
           "Rounds:"]
    for m in small["measures"]:
        out.append(f"- {m}: " + "; ".join(
            f"{r['rows']:,}: " + ", ".join(_fmt(v) for v in r["measures"][m]["rounds"])
            for r in results))
    out += ["", "Sizes and fill times:"] + [line for r in results for line in size_lines(r)]
    for r in results:
        for what, found in r["plans"].items():
            out += ["", f"## Plans at {r['rows']:,} rows: {what}", ""]
            shown = _distinct(found)
            out += [f"```\n{p}\n```" for p in shown] or ["(none logged)"]
            if len(shown) < len(found):
                out.append(f"({len(found) - len(shown)} more of the same statements: "
                           "in the JSON)")
    return "\n".join(out)


def _distinct(plans: list[str]) -> list[str]:
    """The first plan of each statement (told apart by its query text's first 60
    characters)."""
    seen: set[str] = set()
    out = []
    for plan in plans:
        query = plan.split("Query Text:", 1)[-1].strip()[:60]
        if query not in seen:
            seen.add(query)
            out.append(plan)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000, help="the big table")
    parser.add_argument("--small", type=int, default=10_000, help="the table compared with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--enqueue", type=int, default=20_000, help="tasks per round")
    parser.add_argument("--enqueue-batch", type=int, default=1000)
    parser.add_argument("--single", type=int, default=300, help="single enqueues per round")
    parser.add_argument("--idle-calls", type=int, default=200, help="idle preloads per round")
    parser.add_argument("--busy", type=int, default=10_000, help="tasks due in the window")
    parser.add_argument("--status-calls", type=int, default=3, help="ax status per round")
    parser.add_argument("--server", choices=("private", "shared"), default="private",
                        help="private: a PostgreSQL server of the benchmark's own, configured "
                        "as PostgreSQL advises for a dedicated server (needs root); shared: "
                        "the one at AX_BENCH_PG_URL, as it is configured")
    args = parser.parse_args(argv)
    if args.small < 1000 or args.rows <= args.small:
        parser.error("give --small of at least 1,000 and --rows above it")
    wait_quiet()
    results = run(args)
    text_out = report(results, args)
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"bigtable-{args.rows}-{datetime.now(UTC):%Y%m%dT%H%M%SZ}"
    stem.with_suffix(".md").write_text(text_out + "\n")
    stem.with_suffix(".json").write_text(json.dumps(
        {"args": vars(args), "machine": machine(), "results": results}, indent=1) + "\n")
    print(text_out)
    print(f"\nwritten: {stem}.md, {stem}.json")


if __name__ == "__main__":
    main()
