"""The tables beside the tasks, as SQLAlchemy Core: the cluster's nodes and their id leases,
recurring jobs, and what operators set and are told (limits, pauses, alerts, the audit).
Alembic migrations create and upgrade them; :mod:`ax_kombu.store.schema` gathers them with
the task tables, and its conventions hold here too (times are integers of epoch
milliseconds from the database clock; each index has its reason, given at its table).
"""

from __future__ import annotations

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

from ax_kombu.store.table_base import cold_copy, metadata

_ACTIVE_JOB = "NOT paused AND next_fire_at IS NOT NULL"

#: who changed what, when (migration 0023; issue 40): one row per state-changing action of
#: the console, the CLI or the client. ``at`` epoch ms, ``detail`` JSON text (NULL: none).
#: Index: ``(at)`` — ``ax audit --since`` and the retention ask by time.
audit = Table(
    "ax_audit", metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("at", BigInteger, nullable=False),
    Column("actor", String(128), nullable=False),
    Column("via", String(16), nullable=False),
    Column("action", String(64), nullable=False),
    Column("target", String(256), nullable=False),
    Column("detail", Text),
    Index("ix_ax_audit_at", "at"),
)
audit_archive = cold_copy(audit, "ax_audit_archive", Index("ix_ax_audit_archive_at", "at"))

#: per-type alerts (migration 0024; issue 40, :mod:`ax_kombu.alerts`): one row per alerted
#: task type, what to watch (``on_failed``, ``on_late`` after ``late_after_ms``), where to
#: send it (``webhook``, signed with ``secret``, a Standard Webhooks ``whsec_`` key), and its
#: incident state: ``checked_until`` (epoch ms) the end of the last window the evaluator
#: looked at, the compare-and-set token that decides which scheduler sends; ``opened_at``
#: the open incident's start (NULL: none open), ``last_event_at`` its latest event, and
#: ``events`` / ``sample_task_id`` what it counted. Index: the primary key (a few rows).
alerts = Table(
    "ax_alert", metadata,
    Column("task_type", String(128), primary_key=True),
    Column("on_failed", Boolean, nullable=False),
    Column("on_late", Boolean, nullable=False),
    Column("late_after_ms", BigInteger),
    Column("webhook", String(2048), nullable=False),
    Column("secret", String(128), nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    Column("checked_until", BigInteger, nullable=False),
    Column("opened_at", BigInteger),
    Column("last_event_at", BigInteger),
    Column("events", Integer, nullable=False, server_default="0"),
    Column("sample_task_id", BigInteger),
    # the messages not yet delivered, a JSON list (NULL: none), and the lease of the
    # scheduler delivering them (epoch ms; migration 0026)
    Column("outbox", Text),
    Column("outbox_claimed_until", BigInteger),
    CheckConstraint("on_failed OR on_late", name="ck_ax_alert_watches"),
    CheckConstraint("NOT on_late OR late_after_ms > 0", name="ck_ax_alert_late_after"),
)

#: paused task types (``kind`` "type") and queues ("queue"), cluster-wide (migration 0025;
#: issue 40): the schedulers leave their tasks unclaimed until the row is deleted. A handful
#: of rows, read whole: no index beyond the primary key.
pauses = Table(
    "ax_pause", metadata,
    Column("kind", String(8), primary_key=True),
    Column("name", String(128), primary_key=True),
    Column("paused_at", BigInteger, nullable=False),
    Column("actor", String(128), nullable=False),
    CheckConstraint("kind IN ('type', 'queue')", name="ck_ax_pause_kind"),
)

#: cluster-wide concurrency limits: at most ``max_running`` tasks of the type DISPATCHING or
#: RUNNING at once (``ax.set_limit``); enforced by the gated claim.
limits = Table(
    "ax_limit", metadata,
    Column("task_type", String(128), primary_key=True),
    Column("max_running", Integer, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    CheckConstraint("max_running >= 1", name="ck_ax_limit_positive"),
)

#: one row per recurring job (``ax.schedule``); its occurrences become ordinary tasks.
#: Index: ``(next_fire_at)`` over active jobs — the materialiser asks "which jobs fire
#: before T" every pass; paused jobs and ended schedules stay out of it.
jobs = Table(
    "ax_job", metadata,
    Column("name", String(128), primary_key=True),
    Column("task_type", String(128), nullable=False),
    Column("payload", Text, nullable=False),
    Column("cron", String(256)),
    Column("every_ms", BigInteger),
    Column("tz", String(64), nullable=False),
    Column("misfire", String(12), nullable=False),
    Column("misfire_grace_ms", BigInteger),
    #: parallel | serial | cover | discard (ax_kombu.store.gates)
    Column("strategy", String(12), nullable=False, server_default="parallel"),
    Column("priority", String(8), nullable=False),
    Column("max_retry", Integer, nullable=False),
    Column("timeout_ms", Integer, nullable=False),
    Column("processor_name", String(255)),
    Column("callback_url", String(2048)),
    Column("paused", Boolean, nullable=False, server_default=text("false")),
    #: where an interval's occurrences count from (epoch ms): anchor + k·every
    Column("anchor_ms", BigInteger, nullable=False),
    #: the first occurrence not yet written as a task (None: the schedule has ended)
    Column("next_fire_at", BigInteger),
    #: a digest of everything above that the user set: an unchanged schedule() writes nothing
    Column("spec", String(32), nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    #: why no scheduler can plan the job (its row cannot be parsed); None: it is planned.
    #: Set by the materialiser (ax_kombu.scheduler.recurrence), cleared by schedule()
    Column("broken", Text),
    CheckConstraint("(cron IS NULL) <> (every_ms IS NULL)", name="ck_ax_job_one_schedule"),
    CheckConstraint("(processor_name IS NULL) <> (callback_url IS NULL)",
                    name="ck_ax_job_one_target"),
    Index("ix_ax_job_due", "next_fire_at",
          postgresql_where=text(_ACTIVE_JOB), sqlite_where=text(_ACTIVE_JOB)),
)

#: 1024 rows, one per snowflake node id; a process leases one (see ids.py).
id_leases = Table(
    "ax_id_lease", metadata,
    Column("slot", Integer, primary_key=True, autoincrement=False),
    Column("owner", String(128)),
    Column("lease_until", BigInteger, nullable=False, server_default="0"),
)

#: one row per live scheduler or worker process, refreshed by its heartbeat.
nodes = Table(
    "ax_node", metadata,
    Column("node_id", String(128), primary_key=True),
    Column("kind", String(16), nullable=False),
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    #: which process start this is: a heartbeat only counts for the live incarnation
    Column("incarnation", BigInteger, nullable=False, server_default="0"),
    Column("started_at", BigInteger, nullable=False),
    Column("heartbeat_at", BigInteger, nullable=False),
    Column("stopped_at", BigInteger),
    Column("info", Text, nullable=False, server_default="{}"),
    #: a worker's listed runs: RUNNING tasks it has staged and will not start before a
    #: later write without them (``,id,id,``; :mod:`ax_kombu.worker.listing`): they never
    #: started (migration 0013; named so by 0020)
    Column("listed_runs", Text),
    #: an operator asked this worker to be quiet (``ax workers quiet``) at this time (epoch
    #: ms; NULL: not asked, or resumed): it starts nothing new (migration 0025)
    Column("quiet_at", BigInteger),
)
