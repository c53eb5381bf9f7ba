"""The sections of :class:`ax_kombu.config.Settings`, one per reader: what every process
reads (:class:`CommonSettings`), what ``enqueue`` reads (:class:`ProducerSettings`), and
what each daemon reads (:class:`SchedulerSettings`, :class:`WorkerSettings`). Each checks
its own fields; :mod:`ax_kombu.config` makes one flat record of them and reads them from
the environment.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ax_kombu.exceptions import ConfigurationError

#: what ``rabbitmq_queue_type`` may say
RABBITMQ_QUEUE_TYPES = ("classic", "quorum")
#: what ``callback_signing`` may say
CALLBACK_SIGNINGS = ("standard", "legacy")


@dataclass(frozen=True, kw_only=True)
class CommonSettings:
    """What every process reads: the store, the broker and its queues, id reservations,
    heartbeats."""

    database_url: str = "sqlite:///ax.sqlite3"
    #: run Alembic migrations on first use (always on for SQLite).
    auto_migrate: bool = False
    broker_url: str = "ax+sqlite:///ax-broker.sqlite3"
    #: Redis only: a prefix for every key ax's queues use (isolates deployments).
    broker_key_prefix: str = ""
    #: Redis only: Kombu's ack emulation (an unacked-message hash, two extra round trips
    #: per message). ax does not need it: a message lost between broker and worker leaves
    #: its task DISPATCHING, and the ack timeout dispatches it again.
    redis_ack_emulation: bool = False
    #: RabbitMQ only: publish ax's messages persistent (delivery mode 2), so that they
    #: survive a broker restart. Off by default, for the reason above: the database keeps
    #: every task, and a message the broker loses leaves its task DISPATCHING until the
    #: ack timeout dispatches it again (the queue is then empty, so it is known lost);
    #: persistence costs the broker a disk write per message. Celery-bound messages are
    #: always persistent (a stock Celery worker's task has left the database's care).
    rabbitmq_persistent: bool = False
    #: RabbitMQ only: the type ax's queues are declared with, ``classic`` or ``quorum``
    #: (replicated over a cluster's nodes; every message in one is kept on disk, so
    #: ``rabbitmq_persistent`` does not apply). A queue keeps the type it was first declared
    #: with: changing it means deleting ax's queues while they are empty.
    rabbitmq_queue_type: str = "classic"
    #: a JSON object merged into Kombu's transport options for every transport (after ax's
    #: own), e.g. ``{"master_name": "mymaster"}`` for ``sentinel://`` URLs
    broker_transport_options: str = ""
    queue_high: str = "high"
    queue_default: str = "default"
    queue_slow: str = "slow"
    #: how long a process keeps its snowflake node number reserved (an id reservation in
    #: ``ax_id_lease``) before renewing it; ``AX_NODE_LEASE_S``: the deprecated name.
    id_reservation_s: int = 600
    #: how often a process writes its heartbeat (one UPDATE of its node row). Short, so a
    #: dead node's work moves in seconds: with the default misses, a node silent for 3 s is
    #: dead (its incarnation's fence makes a short lease safe; docs/deploy.md, "Heartbeats").
    heartbeat_interval_s: float = 1.0
    #: a node is dead after this many missed heartbeats.
    heartbeat_misses: int = 3
    #: a clock offset to the database above this is reported.
    clock_skew_warn_ms: int = 50

    def queue_for(self, priority: str) -> str:
        """The broker queue name that serves ``priority``."""
        return {"high": self.queue_high, "default": self.queue_default,
                "slow": self.queue_slow}[priority]

    @property
    def silence_ms(self) -> int:
        """How long a node may go without a heartbeat before it counts as dead."""
        return int(self.heartbeat_interval_s * 1000 * self.heartbeat_misses)

    @property
    def lease_s(self) -> float:
        """How long a landed heartbeat lets a node act under its incarnation
        (:class:`~ax_kombu.core.lease.Lease`): the silence window less one interval (at
        most half of it), a margin for the beat's own round trip and clock rates."""
        silence_s = self.silence_ms / 1000.0
        return silence_s - min(self.heartbeat_interval_s, silence_s / 2)

    def transport_options(self) -> dict[str, Any]:
        """``broker_transport_options`` as a dict (empty when unset).

        Raises:
            ConfigurationError: it is not a JSON object.
        """
        if not self.broker_transport_options.strip():
            return {}
        try:
            value = json.loads(self.broker_transport_options)
        except ValueError as exc:
            raise ConfigurationError(f"broker_transport_options is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigurationError("broker_transport_options must be a JSON object, got "
                                     f"{type(value).__name__}")
        return value

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    def _validate_common(self) -> None:
        if not self.database_url:
            raise ConfigurationError("database_url is empty")
        if not self.broker_url:
            raise ConfigurationError("broker_url is empty")
        _positive(self, "id_reservation_s", "heartbeat_misses")
        if self.rabbitmq_queue_type not in RABBITMQ_QUEUE_TYPES:
            raise ConfigurationError(f"rabbitmq_queue_type must be one of "
                                     f"{', '.join(RABBITMQ_QUEUE_TYPES)}, got "
                                     f"{self.rabbitmq_queue_type!r}")
        self.transport_options()  # raises for one that is not a JSON object
        if len({self.queue_high, self.queue_default, self.queue_slow}) != 3:
            raise ConfigurationError("the high, default and slow queues need distinct names")


@dataclass(frozen=True, kw_only=True)
class ProducerSettings:
    """What ``enqueue`` reads: the duplicate check, the payload's bound, a task's defaults."""

    #: two tasks with the same type and payload closer than this are duplicates. On
    #: PostgreSQL a task's check makes a probe per 17.5-minute bucket its window touches
    #: (at most two up to 8 minutes, eight for an hour): a wider window costs more probes.
    dedup_window_ms: int = 5000
    max_payload_bytes: int = 65536
    default_max_retry: int = 3
    default_timeout_ms: int = 60_000

    def _validate_producer(self) -> None:
        _positive(self, "max_payload_bytes")
        _positive(self, "dedup_window_ms", zero_ok=True)


@dataclass(frozen=True, kw_only=True)
class SchedulerSettings:
    """What ``ax-scheduler`` reads: the preload, the claim, recovery, recurring jobs,
    retention."""

    #: how far ahead tasks are loaded from the database.
    preload_window_ms: int = 10_000
    #: most rows loaded per preload round.
    preload_batch: int = 20_000
    #: how often the preload runs without a wake-up (SQLite: at most 50 ms).
    preload_interval_ms: int = 1000
    #: most task ids loaded in memory at once (the timing wheel and its delay queue);
    #: ``AX_MAX_HELD``: the deprecated name.
    max_loaded: int = 500_000
    #: how long an unpublished task waits before it is tried again.
    republish_delay_ms: int = 1000
    #: most rows claimed and published per round trip.
    claim_batch: int = 1000
    #: claim and publish tasks up to this long before they are due (staging);
    #: the worker fences each (RUNNING) on receipt and starts it at its trigger time,
    #: never before, so the claim, the publish and the RUNNING commit (whose disk flush
    #: is slow now and then) are not part of its lateness. Within this
    #: window ``ax cancel`` signals the task like a running one (``ctx.cancelled``).
    #: (A longer lead does not start a burst sooner: the worker's CPU bounds it, not the
    #: pipeline ahead of the due time: docs/benchmarks.md, "Issue 21, second session".)
    claim_lead_ms: int = 250
    #: when the next task reaches ``claim_lead_ms``, the claim also takes those due up to this
    #: much later: a stream's next few milliseconds go out in one claim and one publish, not
    #: one each, and the workers' RUNNING commits gather too (at 500 tasks/s, 20 ms gathers
    #: about eleven; docs/benchmarks.md, "Issue 39, sixth session"). Those are staged up to
    #: this much longer, and none starts before its trigger time. 0: each is claimed at its
    #: own lead; with ``claim_lead_ms`` 0 (nothing claimed before it is due) there is no
    #: window either, and lead and window together reach at most 1 s.
    claim_window_ms: int = 20
    #: a task DISPATCHING longer than this goes back to READY; the wait doubles
    #: with each re-dispatch of the same task.
    ack_timeout_ms: int = 30_000
    #: a task dispatched this many times without a worker starting it fails.
    max_dispatches: int = 10
    #: how far ahead recurring jobs' occurrences are written as tasks (at most
    #: ``preload_window_ms``); a scheduler outage shorter than this delays occurrences
    #: instead of missing them.
    job_lookahead_ms: int = 2000
    #: how often the recurring jobs are looked at.
    job_interval_ms: int = 250
    #: recurring jobs with ``misfire="fire_all"``: most missed occurrences run after an outage.
    misfire_max: int = 100
    #: how often orphaned due tasks are looked for.
    recovery_interval_s: float = 30.0
    #: archive finished tasks older than this (ms; ``AX_RETENTION=7d``) into the
    #: archive tables, continuously (:mod:`ax_kombu.scheduler.retention`); 0: off.
    retention: int = 0
    #: how often the retention pass runs (when ``retention`` is on).
    retention_interval_s: float = 60.0
    #: most tasks the retention moves per transaction.
    retention_batch: int = 1000
    #: the retention's pause after each batch, so that the live load's latency stays
    #: close to what it is without an archive running (docs/benchmarks.md, "Issue 14: ``ax
    #: archive`` under a steady 1,000 tasks/s"); lower it if
    #: the retention cannot keep up.
    retention_pause_ms: int = 500
    #: the ``ax_node`` rows of nodes stopped (or declared dead) longer ago than
    #: this are deleted (``ax status`` shows the recent ones); 0: never.
    node_retention_s: float = 86_400.0
    #: the duplicate check's entries (``ax_fingerprint``) of tasks created longer
    #: ago than this, and due before the dedup window, are deleted; 0: never.
    fingerprint_retention_s: float = 86_400.0
    #: how often a scheduler looks at the per-type alerts (``ax.set_alert``;
    #: :mod:`ax_kombu.alerts.evaluator`).
    alert_interval_ms: int = 2000
    #: an alert's incident closes ("resolved") after this long without a new event.
    alert_quiet_ms: int = 300_000
    #: how long the scheduler delivering an alert's message has it alone (pushed back while
    #: it retries); past that another scheduler takes it over (:mod:`ax_kombu.alerts.outbox`).
    alert_takeover_ms: int = 60_000

    @property
    def claim_reach_ms(self) -> int:
        """How far ahead of its time a claim takes tasks: ``claim_lead_ms``, then
        ``claim_window_ms`` (none without a lead), never past 1 s (the most a lead may be)."""
        if not self.claim_lead_ms:
            return 0
        return min(1000, self.claim_lead_ms + self.claim_window_ms)

    def _validate_scheduler(self) -> None:
        _positive(self, "preload_window_ms", "preload_batch", "claim_batch",
                  "preload_interval_ms", "max_loaded", "ack_timeout_ms", "max_dispatches",
                  "job_lookahead_ms", "job_interval_ms", "misfire_max")
        _positive(self, "claim_lead_ms", "claim_window_ms", zero_ok=True)
        if self.claim_lead_ms > 1000:
            raise ConfigurationError(f"claim_lead_ms must be at most 1000, got {self.claim_lead_ms}")
        if self.claim_window_ms > 1000:
            raise ConfigurationError(
                f"claim_window_ms must be at most 1000, got {self.claim_window_ms}")
        if self.job_lookahead_ms > self.preload_window_ms:
            raise ConfigurationError(f"job_lookahead_ms ({self.job_lookahead_ms}) must not "
                                     f"exceed preload_window_ms ({self.preload_window_ms})")
        if self.retention < 0:
            raise ConfigurationError(f"retention must not be negative, got {self.retention} ms")
        if self.node_retention_s != 0 and not 60 <= self.node_retention_s <= 366 * 86_400:
            raise ConfigurationError("node_retention_s must be 0 (keep node rows) or between "
                                     f"60 and 31622400 (366 days), got {self.node_retention_s}")
        if self.fingerprint_retention_s != 0 and not (
                60 <= self.fingerprint_retention_s <= 366 * 86_400):
            raise ConfigurationError(
                "fingerprint_retention_s must be 0 (keep the entries) or between 60 and "
                f"31622400 (366 days), got {self.fingerprint_retention_s}")
        if self.retention_interval_s <= 0:
            raise ConfigurationError("retention_interval_s must be positive, got "
                                     f"{self.retention_interval_s}")
        if self.retention_pause_ms < 0:
            raise ConfigurationError("retention_pause_ms must not be negative, got "
                                     f"{self.retention_pause_ms}")
        if not 1 <= self.retention_batch <= 10_000:
            raise ConfigurationError("retention_batch must be between 1 and 10000, got "
                                     f"{self.retention_batch}")
        _positive(self, "alert_interval_ms", "alert_quiet_ms", "alert_takeover_ms")


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """What ``ax-worker`` reads: its pools and stage, results, retries, callbacks."""

    #: worker on Redis ≥ 6.2: pop messages in batches (ax_kombu.broker.redis_pull) instead of Kombu's
    #: consumer (one BRPOP per message). Off: the plain consumer, as on other brokers.
    redis_pull: bool = True
    #: a processor's return value is stored (as JSON) up to this size.
    max_result_bytes: int = 65536
    #: slots of the pool serving each queue: runs at once, sync and async together (one
    #: thread per slot, up to ``lane_threads_max``).
    pool_high: int = 8
    pool_default: int = 16
    pool_slow: int = 8
    #: most threads of one lane's pool: a lane with more slots runs its sync processors
    #: on this many threads, and slots beyond its threads only serve ``async def``
    #: processors (one event loop per worker process awaits them).
    lane_threads_max: int = 256
    #: slots for what is sent to this worker alone (``shards="workers"``), from
    #: its own queue (``ax.worker.<name>``).
    pool_own: int = 2
    #: broker prefetch per queue = pool slots not in use × this (plus the stage).
    prefetch_multiplier: int = 1
    #: each lane stages (fences RUNNING ahead of a free thread) what its threads
    #: finish within this horizon at the measured run time, at most 200 per thread; 0: none.
    worker_stage_horizon_ms: int = 1000
    #: retry n waits min(max, base · 2ⁿ), minus up to ``jitter`` of it at random.
    retry_backoff_base_ms: int = 1000
    retry_backoff_max_ms: int = 600_000
    retry_backoff_jitter: float = 0.5
    #: most times a task may snooze (``raise ax.Snooze(s)``: run again later, no
    #: retry counted), counted as its attempts that were not retries; past it a snooze
    #: counts as a failure.
    max_snoozes: int = 100
    #: on a warm shutdown, how long running tasks may take to finish.
    worker_grace_s: float = 30.0
    #: most state changes written by one statement.
    worker_batch_size: int = 500
    #: longest a finished run's result waits to be written with others: fewer, larger
    #: result commits leave more of the CPU to the runs in a burst (docs/benchmarks.md,
    #: "Issue 21, third session"); a
    #: run's start is not delayed, only its result and its message's ack.
    worker_batch_ms: int = 20
    #: batches of received tasks being moved to RUNNING at once (one connection each).
    worker_receipt_writers: int = 2
    #: comma-separated modules to import; dotted-path processors must be in them.
    processor_modules: str = ""
    #: comma-separated hosts (or ``*.domain``) callback_url may name, internal
    #: addresses allowed; empty: any host whose addresses are all public.
    callback_allow_hosts: str = ""
    #: signs every callback request (HMAC-SHA256) when set; never shown or logged.
    callback_secret: str = dataclasses.field(default="", repr=False)
    #: how a callback request is signed (with ``callback_secret``): ``standard`` (Standard
    #: Webhooks: ``webhook-id``, ``webhook-timestamp``, ``webhook-signature``) or ``legacy``
    #: (``X-Ax-Timestamp``, ``X-Ax-Signature``; kept for one release).
    callback_signing: str = "standard"
    #: each run's own log lines kept with its attempt (``ax inspect ID --logs``): at most
    #: this many lines and bytes per run, its first lines and its last few; 0: none kept.
    run_log_lines: int = 200
    run_log_bytes: int = 65536

    def pool_size(self, priority: str) -> int:
        """The worker pool size for the queue of ``priority``."""
        return {"high": self.pool_high, "default": self.pool_default,
                "slow": self.pool_slow}[priority]

    def _validate_worker(self) -> None:
        _positive(self, "max_result_bytes", "pool_high", "pool_default", "pool_slow", "pool_own",
                  "lane_threads_max", "prefetch_multiplier", "worker_batch_size", "worker_batch_ms",
                  "worker_receipt_writers")
        if not 0 <= self.worker_stage_horizon_ms <= 60_000:
            raise ConfigurationError("worker_stage_horizon_ms must be 0..60000, got "
                                     f"{self.worker_stage_horizon_ms}")
        if not 0 <= self.retry_backoff_base_ms <= self.retry_backoff_max_ms:
            raise ConfigurationError("retry backoff needs 0 <= retry_backoff_base_ms <= "
                                     "retry_backoff_max_ms")
        if not 0.0 <= self.retry_backoff_jitter <= 1.0:
            raise ConfigurationError("retry_backoff_jitter must be within [0, 1]")
        if self.worker_grace_s < 0:
            raise ConfigurationError("worker_grace_s must be >= 0")
        if self.max_snoozes < 0:
            raise ConfigurationError(f"max_snoozes must be >= 0, got {self.max_snoozes}")
        if self.callback_signing not in CALLBACK_SIGNINGS:
            raise ConfigurationError(f"callback_signing must be one of "
                                     f"{', '.join(CALLBACK_SIGNINGS)}, got "
                                     f"{self.callback_signing!r}")
        if not 0 <= self.run_log_lines <= 100_000:
            raise ConfigurationError(f"run_log_lines must be 0..100000, got {self.run_log_lines}")
        if not (self.run_log_bytes == 0 or 1024 <= self.run_log_bytes <= 16 << 20):
            raise ConfigurationError("run_log_bytes must be 0 or 1024..16777216, got "
                                     f"{self.run_log_bytes}")


def _positive(settings: Any, *names: str, zero_ok: bool = False) -> None:
    """Refuse a negative (or, unless ``zero_ok``, zero) value of each of ``names``."""
    for name in names:
        value = getattr(settings, name)
        if value < 0 or (not zero_ok and value == 0):
            raise ConfigurationError(f"{name} must be positive, got {value}")
