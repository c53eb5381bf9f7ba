"""The tables, as SQLAlchemy Core. Alembic migrations create and upgrade them.

Here: the task table, ``ax_task``, and the tables that follow a task (its duplicate-check
entry, its due times, its earlier attempts, its moves, its run logs, and the archive's
copies). The tables beside the tasks (nodes and id leases, recurring jobs, limits, pauses,
alerts, the audit) are in :mod:`ax_kombu.store.cluster_tables`; every table is on one
``metadata`` (:mod:`ax_kombu.store.table_base`), and all are importable from here.

Times are integers of milliseconds since the Unix epoch, taken from the
database clock (see :mod:`ax_kombu.store.clock`), so PostgreSQL and SQLite
store and compare them the same way and nothing depends on a time zone.

Indexes, each with its reason:

* ``(status, trigger_time)`` — the preload and recovery scans ask "tasks in
  status S due before T"; with status first the scan is one tight index range
  and never walks the finished history (SPEC lists the pair as
  ``(trigger_time, status)``; this order serves the same queries without reading
  every old row). On PostgreSQL partial to the waiting and finished states, and:
* ``(task_type, status)`` partial to the in-flight ones (DISPATCHING, RUNNING) — the
  cluster-wide limits count a type's; the ack-timeout and dead-worker scans read it
  whole (as many entries as tasks in flight). The two split the states, so each of a
  task's four row versions writes one entry, not two (migration 0011). SQLite keeps
  both full: it uses a partial index only for a query that repeats its ``WHERE``.
  A query over states of both kinds reads each state apart
  (:func:`ax_kombu.store.stats.schedule_delays`).
* none for the duplicate check: its ``(fingerprint, trigger_time)`` pairs live in their
  own table, ``ax_fingerprint``, written once at enqueue. As an index of ``ax_task`` it
  took an entry on each of a task's four versions, a quarter of PostgreSQL's CPU per task
  (migration 0012).
* none for what became claimable since a preload's last read: the preload asks
  ``ax_due`` (migration 0016; ``ax_task.armed`` went in migrations 0018 and 0020).
* unique ``(job, scheduled_at)`` over occurrences of recurring jobs — exactly one task
  per occurrence, whichever scheduler writes it first (see :mod:`ax_kombu.store.jobs`);
  partial: one-off tasks (``job IS NULL``) write no entry there.
* ``(order_key, order_seq, task_id)`` over tasks that have an order_key — "is this
  key busy, and which of its tasks comes first" at claim time; others write no entry.
* unique ``(task_type, biz_key)`` — idempotent enqueue by business key
  (NULL biz_keys never conflict, on both databases). On PostgreSQL a partial
  index over rows that have a biz_key: a task without one (most) writes no
  entry there on each of its status changes.

On PostgreSQL ``ax_task`` has a fillfactor of 70 (migration 0011): a row's next version
usually lands on its page, and is logged as what changed.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Index,
    Integer,
    String,
    Table,
    Text,
    text,
)

from ax_kombu.core.runners import default_runner
from ax_kombu.store.cluster_tables import (
    alerts,
    audit,
    audit_archive,
    id_leases,
    jobs,
    limits,
    nodes,
    pauses,
)
from ax_kombu.store.table_base import cold_copy, metadata

__all__ = [
    "CLAIMABLE", "PROBE_BUCKET_BITS", "PROBE_SQL", "UNPARKED", "alerts", "attempt_archive",
    "attempts", "audit", "audit_archive", "due", "fingerprints", "id_leases", "jobs",
    "limits", "metadata", "moves", "nodes", "pauses", "run_log_archive", "run_logs",
    "task_archive", "tasks",
]


#: the states a scheduler claims from (:mod:`ax_kombu.store.claims`); CREATED only in rows
#: written before migration 0011 or by older producers
CLAIMABLE = "status IN ('CREATED', 'DELAYED', 'READY')"
#: SQL: the row is not parked (``ax_task.parked``: the gated claim parked it until its key
#: or limit has room, :mod:`ax_kombu.store.gates`; claimable, but read by no preload)
UNPARKED = "NOT parked"
_WAITING_OR_DONE = ("status IN ('CREATED', 'DELAYED', 'READY', 'SUCCESS', 'FAILED', "
                    "'CANCELLED')")
_BUSY = "status IN ('DISPATCHING', 'RUNNING')"
_OCCURRENCE = "job IS NOT NULL"
_ORDERED = "order_key IS NOT NULL"


def _default_runner(context: Any) -> str:
    """The runner of an inserted row that names none: 'callback' when it has a
    callback_url, else 'ax' (:func:`ax_kombu.core.runners.default_runner`; never from a
    name: a row for another runner names it)."""
    return default_runner(context.get_current_parameters().get("callback_url"))


tasks = Table(
    "ax_task", metadata,
    Column("task_id", BigInteger, primary_key=True, autoincrement=False),
    Column("task_type", String(128), nullable=False),
    Column("trigger_time", BigInteger, nullable=False),
    Column("status", String(12), nullable=False),
    Column("priority", String(8), nullable=False),
    Column("retry_count", Integer, nullable=False, server_default="0"),
    Column("max_retry", Integer, nullable=False),
    Column("timeout_ms", Integer, nullable=False),
    Column("processor_name", String(255)),
    Column("callback_url", String(2048)),
    Column("payload", Text, nullable=False),
    Column("biz_key", String(255)),
    Column("fingerprint", String(32), nullable=False),
    Column("trace_id", String(32), nullable=False),
    #: the fencing token: +1 on every claim; a worker acts only on its own attempt.
    Column("attempt", Integer, nullable=False, server_default="0"),
    #: the node that last took the task: the claiming scheduler, then the running worker
    #: (NULL: a scheduler may claim it again); migration 0021
    Column("owner_node", String(128)),
    #: parked by the gated claim until its key or limit has room (READY; no preload reads
    #: it until a run's end wakes it: :mod:`ax_kombu.store.gates`); migration 0021
    Column("parked", Boolean, nullable=False, server_default=text("false")),
    Column("created_at", BigInteger, nullable=False),
    Column("dispatched_at", BigInteger),
    Column("started_at", BigInteger),
    Column("finished_at", BigInteger),
    Column("last_error", Text),
    #: times the ack timeout sent the task out again unstarted (bounded by max_dispatches)
    Column("redispatches", Integer, nullable=False, server_default="0"),
    #: the recurring job this task is an occurrence of, and that occurrence's time (epoch ms)
    Column("job", String(128)),
    Column("scheduled_at", BigInteger),
    #: tasks with the same order_key run one at a time, in (order_seq, task_id) order;
    #: order_seq is the first trigger time (a retry keeps its place)
    Column("order_key", String(255)),
    Column("order_seq", BigInteger),
    #: what the claim must check before this task may start (NULL: nothing; see
    #: ax_kombu.store.gates): 'order', 'order_skip' (skip_failed), 'discard', 'cover',
    #: 'workers' (one shard per live worker, made when it is claimed)
    Column("gate", String(12)),
    #: claimed by the gated claim: its end frees a slot or a key (the worker wakes the next)
    Column("gated", Boolean, nullable=False, server_default=text("false")),
    #: one of ``shard_total`` tasks made by one enqueue (ctx.shard_index, ctx.shard_total)
    Column("shard_index", Integer),
    Column("shard_total", Integer),
    #: a shard of ``shards="workers"``: the worker it is sent to (its own queue)
    Column("target_node", String(128)),
    #: the processor's return value as JSON (SUCCESS only; at most AX_MAX_RESULT_BYTES)
    Column("result", Text),
    #: where the task runs (:data:`ax_kombu.core.runners.RUNNERS`): set when the row is made,
    #: never derived from a name afterwards; only :mod:`ax_kombu.celery` writes a Celery
    #: runner. Not given: 'callback' for a row with a callback_url, else 'ax'
    #: (:func:`_default_runner`)
    Column("runner", String(12), nullable=False, default=_default_runner,
           server_default="ax"),
    #: the biz_key this finished task kept until an ``enqueue(..., unique="pending")`` of
    #: the same key took it over (migration 0019); no index: only listings read it
    Column("released_key", String(255)),
    #: the W3C trace context current at enqueue (OpenTelemetry, migration 0022), carried
    #: into the message headers; NULL: enqueued without a trace
    Column("traceparent", String(55)),
    Column("tracestate", String(512)),
    # PostgreSQL: a partial unique index (rows without a biz_key stay out of it, so their
    # status changes do not write to it); SQLite keeps the plain constraint (migration 0003)
    Index("uq_ax_task_type_biz_key", "task_type", "biz_key", unique=True,
          postgresql_where=text("biz_key IS NOT NULL")),
    CheckConstraint("(processor_name IS NULL) <> (callback_url IS NULL)",
                    name="ck_ax_task_one_target"),
    Index("ix_ax_task_status_trigger", "status", "trigger_time",
          postgresql_where=text(_WAITING_OR_DONE)),
    Index("ix_ax_task_type_status", "task_type", "status", postgresql_where=text(_BUSY)),
    Index("uq_ax_task_occurrence", "job", "scheduled_at", unique=True,
          postgresql_where=text(_OCCURRENCE), sqlite_where=text(_OCCURRENCE)),
    Index("ix_ax_task_order", "order_key", "order_seq", "task_id",
          postgresql_where=text(_ORDERED), sqlite_where=text(_ORDERED)),
)

#: the duplicate check's probe of an entry (PostgreSQL): the ~17.5-minute bucket of its
#: trigger time (``trigger_time >> 20``) in the high bits, the first 32 bits of its
#: fingerprint in the low ones (ax's fingerprints are hex digests); ``{t}`` is the table's
#: alias and dot, or empty. ``ix_ax_fingerprint_probe`` (migration 0017) is a B-tree on
#: exactly this expression (:func:`ax_kombu.store.enqueue.probes` computes it in Python).
PROBE_BUCKET_BITS = 20
PROBE_SQL = (f"((({{t}}trigger_time >> {PROBE_BUCKET_BITS}) << 32) "
             "| ('x' || left({t}fingerprint, 8))::bit(32)::bigint)")

#: the duplicate check's side of each task enqueued through ``ax.enqueue``: written once,
#: beside the task, and never updated, so a task's status changes write nothing here. The
#: check joins it to ``ax_task`` (a cancelled or removed task duplicates nothing); the
#: trigger time is the one the producer asked for. Archive and purge delete a task's entry
#: with the task; the schedulers delete entries of tasks created more than
#: ``fingerprint_retention_s`` ago whose trigger time has passed. Indexes: on PostgreSQL a
#: B-tree on the entry's probe (its trigger time's 17.5-minute bucket above 32 bits of
#: its fingerprint: :data:`PROBE_SQL`, migration 0017), the check's
#: lookup, where the entries due together sit together whatever the table's size; and a
#: BRIN on task_id, for that prune; no primary key. SQLite keeps the primary key
#: (fingerprint, trigger_time, task_id) it was made with.
fingerprints = Table(
    "ax_fingerprint",
    metadata,
    Column("fingerprint", String(32), nullable=False),
    Column("trigger_time", BigInteger, nullable=False),
    Column("task_id", BigInteger, nullable=False),
    Index("ix_ax_fingerprint_probe", text(PROBE_SQL.format(t="")))
    .ddl_if(dialect="postgresql"),
    # PostgreSQL: the prune's lookup of old entries by creation (snowflake ids grow with it)
    Index("ix_ax_fingerprint_task", "task_id", postgresql_using="brin")
    .ddl_if(dialect="postgresql"),
)

#: when claimable tasks fall due, for the scheduler's steady preload rounds (migration 0016,
#: :mod:`ax_kombu.store.preload`): an entry per task made due at a time (inserted
#: claimable, made claimable again, given a new trigger time, woken from parked), written by
#: the database's triggers whoever writes the task, never updated. ``armed``: the writer's
#: transaction (PostgreSQL) or the next value of a counter (SQLite, ``ax_armed``). An
#: entry its task has moved on from is refused by the claim, and deleted by the schedulers
#: once its time has passed (:func:`ax_kombu.store.preload.prune_due`). Four numbers wide,
#: so the entries written together share a few pages, however large ``ax_task`` is.
#: Indexes: ``(trigger_time)`` — the band of a preload round, and the prune;
#: ``(armed)`` — what became due since the last round. No primary key.
due = Table(
    "ax_due",
    metadata,
    Column("task_id", BigInteger, nullable=False),
    Column("trigger_time", BigInteger, nullable=False),
    Column("runner", String(12), nullable=False),
    Column("armed", BigInteger, nullable=False),
    Index("ix_ax_due_time", "trigger_time"),
    Index("ix_ax_due_armed", "armed"),
)

#: one row per ended attempt of a task that is not the task's final state (a retried run, a
#: run cut short by a cancel, a lost or unacknowledged dispatch): who ran it, when, how it
#: ended. The final attempt is the task row itself (status, owner_node, dispatched_at,
#: started_at, finished_at, last_error), so a task that succeeds at once writes nothing
#: here (a row for every attempt is one more heap row and key per task on the hot path:
#: docs/benchmarks.md, "Issue 14: what the attempt history costs the hot path");
#: ``ax retry`` moves the final attempt here before it starts a new one.
#: Indexes: the primary key; ``(task_type, finished_at)`` — run-time statistics per type
#: (``ax plan --from-history``) and the time-ordered scans of retention.
attempts = Table(
    "ax_attempt", metadata,
    Column("task_id", BigInteger, primary_key=True, autoincrement=False),
    Column("attempt", Integer, primary_key=True, autoincrement=False),
    Column("task_type", String(128), nullable=False),
    #: the worker that ran it (or, never started, the scheduler that dispatched it)
    Column("node", String(128)),
    Column("trigger_time", BigInteger, nullable=False),
    Column("dispatched_at", BigInteger),
    Column("started_at", BigInteger),
    Column("finished_at", BigInteger, nullable=False),
    #: SUCCESS, FAILED, RETRY (failed; retried), CANCELLED, LOST (its worker died), UNACKED
    #: (no worker started it within the ack timeout)
    Column("outcome", String(12), nullable=False),
    Column("error", Text),
    #: finished_at - started_at (None: never started)
    Column("duration_ms", BigInteger),
    Index("ix_ax_attempt_type_finished", "task_type", "finished_at"),
)

#: one row per move of a pending task (``ax.reschedule``, ``ax.run_now``, an enqueue with
#: ``on_conflict="replace"``; migration 0019), written by the statement's transaction.
#: ``kind``: 'reschedule', 'run_now' or 'replace'; ``attempt``: the task's at the move.
#: Index: ``(task_id)`` — one task's history. Archive and purge delete a task's moves.
moves = Table(
    "ax_move", metadata,
    Column("task_id", BigInteger, nullable=False),
    Column("moved_at", BigInteger, nullable=False),
    Column("from_time", BigInteger, nullable=False),
    Column("to_time", BigInteger, nullable=False),
    Column("kind", String(12), nullable=False),
    Column("attempt", Integer, nullable=False),
    Index("ix_ax_move_task", "task_id"),
)


#: finished tasks moved out of the hot tables (``ax archive``, ``AX_RETENTION``;
#: :mod:`ax_kombu.store.archive`): the same columns, written once and read rarely.
#: Indexes: the primary keys; ``(finished_at)`` — expire the archive itself by age.
task_archive = cold_copy(tasks, "ax_task_archive",
                          Index("ix_ax_task_archive_finished", "finished_at"))
attempt_archive = cold_copy(attempts, "ax_attempt_archive")

#: the log lines one run emitted (its thread's or coroutine's ``logging`` records and
#: ``ctx.log``), bounded by the worker (migration 0022): ``lines`` a JSON list, ``cut`` what
#: was left out (NULL: nothing). A row only for a run that logged; written with its end;
#: archived and purged with its task. Index: the primary key — one task's runs.
run_logs = Table(
    "ax_run_log", metadata,
    Column("task_id", BigInteger, primary_key=True, autoincrement=False),
    Column("attempt", Integer, primary_key=True, autoincrement=False),
    Column("lines", Text, nullable=False),
    Column("cut", Text),
    Column("written_at", BigInteger, nullable=False),
)
run_log_archive = cold_copy(run_logs, "ax_run_log_archive")
