"""One typed settings object for every ax process.

Precedence, lowest first: the defaults below < ``AX_*`` environment variables
< ``ax.configure(...)`` / CLI flags. Every field ``name`` is read from the
variable ``AX_NAME`` (for example ``database_url`` from ``AX_DATABASE_URL``).

With nothing set, ax is embedded and server-free: the store is a SQLite file
and the broker is ax's own SQLite Kombu transport, both in the current
directory, so two terminals in the same folder share them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ax_kombu.exceptions import ConfigurationError

PRIORITIES = ("high", "default", "slow")
#: what ``rabbitmq_queue_type`` may say
RABBITMQ_QUEUE_TYPES = ("classic", "quorum")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, None: 1000}


def parse_duration_ms(text: str) -> int:
    """Parse ``"250ms"``, ``"5s"``, ``"2m"``, ``"1.5h"`` or a bare number of seconds.

    Raises:
        ConfigurationError: the text is not a non-negative duration.
    """
    match = _DURATION.match(text)
    if not match:
        raise ConfigurationError(f"not a duration: {text!r} (use e.g. 500ms, 5s, 2m, 1h)")
    return round(float(match.group(1)) * _UNIT_MS[match.group(2)])


def worker_queue(node_id: str) -> str:
    """The queue a worker consumes besides the priority queues: what is sent to it alone
    (a shard of ``shards="workers"``)."""
    return f"ax.worker.{node_id}"


@dataclass(frozen=True)
class Settings:
    """Everything an ax process can be told. See the module docstring for precedence."""

    database_url: str = "sqlite:///ax.sqlite3"
    broker_url: str = "ax+sqlite:///ax-broker.sqlite3"
    #: Redis only: a prefix for every key ax's queues use (isolates deployments).
    broker_key_prefix: str = ""
    #: Redis only: Kombu's ack emulation (an unacked-message hash, two extra round trips
    #: per message). ax does not need it: a message lost between broker and worker leaves
    #: its task DISPATCHING, and the ack timeout dispatches it again.
    redis_ack_emulation: bool = False
    #: RabbitMQ only: publish ax's messages persistent (delivery mode 2), so that they
    #: survive a broker restart. Off by default, for the reason above: the database holds
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
    #: worker on Redis ≥ 6.2: pop messages in batches (ax_kombu.broker.redis_pull) instead of Kombu's
    #: consumer (one BRPOP per message). Off: the plain consumer, as on other brokers.
    redis_pull: bool = True
    #: run Alembic migrations on first use (always on for SQLite).
    auto_migrate: bool = False
    queue_high: str = "high"
    queue_default: str = "default"
    queue_slow: str = "slow"
    #: two tasks with the same type and payload closer than this are duplicates. On
    #: PostgreSQL a task's check makes a probe per 17.5-minute bucket its window touches
    #: (at most two up to 8 minutes, eight for an hour): a wider window costs more probes.
    dedup_window_ms: int = 5000
    max_payload_bytes: int = 65536
    #: worker: a processor's return value is stored (as JSON) up to this size.
    max_result_bytes: int = 65536
    default_max_retry: int = 3
    default_timeout_ms: int = 60_000
    #: how long a process holds its snowflake node id before renewing it.
    node_lease_s: int = 600
    #: scheduler: how far ahead tasks are loaded from the database.
    preload_window_ms: int = 10_000
    #: scheduler: most rows loaded per preload round.
    preload_batch: int = 20_000
    #: scheduler: how often the preload runs without a wake-up (SQLite: at most 50 ms).
    preload_interval_ms: int = 1000
    #: scheduler: most tasks held in memory at once.
    max_held: int = 500_000
    #: scheduler: how long an unpublished task waits before it is tried again.
    republish_delay_ms: int = 1000
    #: scheduler: most rows claimed and published per round trip.
    claim_batch: int = 1000
    #: scheduler: claim and publish tasks up to this long before they are due (staging);
    #: the worker fences each (RUNNING) on receipt and starts it at its trigger time,
    #: never before, so the claim, the publish and the RUNNING commit (whose disk flush
    #: can take 100 ms or more now and then) are not part of its lateness. Within this
    #: window ``ax cancel`` signals the task like a running one (``ctx.cancelled``).
    #: (A longer lead did not make a 10,000 burst start sooner: the worker's CPU, not the
    #: pipeline ahead of the due time, bounds it; docs/benchmarks.md, issue 21.)
    claim_lead_ms: int = 250
    #: scheduler: a task DISPATCHING longer than this goes back to READY; the wait doubles
    #: with each re-dispatch of the same task.
    ack_timeout_ms: int = 30_000
    #: scheduler: a task dispatched this many times without a worker starting it fails.
    max_dispatches: int = 10
    #: scheduler: how far ahead recurring jobs' occurrences are written as tasks (at most
    #: ``preload_window_ms``); a scheduler outage shorter than this delays occurrences
    #: instead of missing them.
    job_lookahead_ms: int = 2000
    #: scheduler: how often the recurring jobs are looked at.
    job_interval_ms: int = 250
    #: recurring jobs with ``misfire="fire_all"``: most missed occurrences run after an outage.
    misfire_max: int = 100
    #: scheduler: how often orphaned due tasks are looked for.
    recovery_interval_s: float = 30.0
    #: scheduler: archive finished tasks older than this (ms; ``AX_RETENTION=7d``) into the
    #: archive tables, continuously (:mod:`ax_kombu.scheduler.retention`); 0: off.
    retention: int = 0
    #: scheduler: how often the retention pass runs (when ``retention`` is on).
    retention_interval_s: float = 60.0
    #: scheduler: most tasks the retention moves per transaction.
    retention_batch: int = 1000
    #: scheduler: the retention's pause after each batch (about 1,700 tasks/s in batches of
    #: 1,000): the live load's p99 stays within 1.2× of its p99 without an archive running
    #: (docs/benchmarks.md); lower it if the retention cannot keep up.
    retention_pause_ms: int = 500
    #: every process: how often it writes its heartbeat.
    heartbeat_interval_s: float = 5.0
    #: a node is dead after this many missed heartbeats.
    heartbeat_misses: int = 3
    #: scheduler: the ``ax_node`` rows of nodes stopped (or declared dead) longer ago than
    #: this are deleted (``ax status`` shows the recent ones); 0: never.
    node_retention_s: float = 86_400.0
    #: scheduler: the duplicate check's entries (``ax_fingerprint``) of tasks created longer
    #: ago than this, and due before the dedup window, are deleted; 0: never.
    fingerprint_retention_s: float = 86_400.0
    #: a clock offset to the database above this is reported.
    clock_skew_warn_ms: int = 50
    #: worker: threads (slots) of the pool serving each queue.
    pool_high: int = 8
    pool_default: int = 16
    pool_slow: int = 8
    #: worker: slots for what is sent to this worker alone (``shards="workers"``), from
    #: its own queue (``ax.worker.<name>``).
    pool_own: int = 2
    #: worker: broker prefetch per queue = pool slots not in use × this (plus the stage).
    prefetch_multiplier: int = 1
    #: worker: each lane stages (fences RUNNING ahead of a free thread) what its threads
    #: finish within this horizon at the measured run time, at most 200 per thread; 0: none.
    worker_stage_horizon_ms: int = 1000
    #: worker: retry n waits min(max, base · 2ⁿ), minus up to ``jitter`` of it at random.
    retry_backoff_base_ms: int = 1000
    retry_backoff_max_ms: int = 600_000
    retry_backoff_jitter: float = 0.5
    #: worker: most times a task may snooze (``raise ax.Snooze(s)``: run again later, no
    #: retry counted), counted as its attempts that were not retries; past it a snooze
    #: counts as a failure.
    max_snoozes: int = 100
    #: worker: on a warm shutdown, how long running tasks may take to finish.
    worker_grace_s: float = 30.0
    #: worker: most state changes written by one statement.
    worker_batch_size: int = 500
    #: worker: longest a finished run's result waits to be written with others. (20, not 2:
    #: fewer, larger result commits leave more of the CPU to the runs in a burst — a 10,000
    #: burst's p99 1.04 s against 1.21 s, medians of 4 alternating runs, docs/benchmarks.md,
    #: issue 21; a run's start is not delayed, only its result and its message's ack.)
    worker_batch_ms: int = 20
    #: worker: batches of received tasks being moved to RUNNING at once (one connection each).
    worker_receipt_writers: int = 2
    #: worker: comma-separated modules to import; dotted-path processors must be in them.
    processor_modules: str = ""
    #: worker: comma-separated hosts (or ``*.domain``) callback_url may name, internal
    #: addresses allowed; empty: any host whose addresses are all public.
    callback_allow_hosts: str = ""
    #: worker: signs every callback request (HMAC-SHA256) when set; never shown or logged.
    callback_secret: str = dataclasses.field(default="", repr=False)

    def queue_for(self, priority: str) -> str:
        """The broker queue name that serves ``priority``."""
        return {"high": self.queue_high, "default": self.queue_default,
                "slow": self.queue_slow}[priority]

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` applied and validated."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ConfigurationError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        settings = dataclasses.replace(self, **changes)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Raise :class:`ConfigurationError` for a setting that cannot work."""
        if not self.database_url:
            raise ConfigurationError("database_url is empty")
        if not self.broker_url:
            raise ConfigurationError("broker_url is empty")
        for name in ("dedup_window_ms", "max_payload_bytes", "max_result_bytes", "node_lease_s", "preload_window_ms",
                     "preload_batch", "claim_batch", "preload_interval_ms", "max_held",
                     "ack_timeout_ms", "heartbeat_misses", "claim_lead_ms", "max_dispatches",
                     "job_lookahead_ms", "job_interval_ms", "misfire_max"):
            zero_ok = name in ("dedup_window_ms", "claim_lead_ms")
            if getattr(self, name) < 0 or (not zero_ok and getattr(self, name) == 0):
                raise ConfigurationError(f"{name} must be positive, got {getattr(self, name)}")
        self._validate_retention()
        if self.claim_lead_ms > 1000:
            raise ConfigurationError(f"claim_lead_ms must be at most 1000, got {self.claim_lead_ms}")
        if self.job_lookahead_ms > self.preload_window_ms:
            raise ConfigurationError(f"job_lookahead_ms ({self.job_lookahead_ms}) must not "
                                     f"exceed preload_window_ms ({self.preload_window_ms})")
        if self.rabbitmq_queue_type not in RABBITMQ_QUEUE_TYPES:
            raise ConfigurationError(f"rabbitmq_queue_type must be one of "
                                     f"{', '.join(RABBITMQ_QUEUE_TYPES)}, got "
                                     f"{self.rabbitmq_queue_type!r}")
        self.transport_options()  # raises for one that is not a JSON object
        if len({self.queue_high, self.queue_default, self.queue_slow}) != 3:
            raise ConfigurationError("the high, default and slow queues need distinct names")
        self._validate_worker()

    def _validate_retention(self) -> None:
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

    def _validate_worker(self) -> None:
        for name in ("pool_high", "pool_default", "pool_slow", "pool_own", "prefetch_multiplier",
                     "worker_batch_size", "worker_batch_ms", "worker_receipt_writers"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"{name} must be positive, got {getattr(self, name)}")
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

    def pool_size(self, priority: str) -> int:
        """The worker pool size for the queue of ``priority``."""
        return {"high": self.pool_high, "default": self.pool_default,
                "slow": self.pool_slow}[priority]

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


#: settings given as a duration with a unit (``AX_RETENTION=7d``); a bare number is seconds
_DURATIONS = frozenset({"retention"})


def _coerce(name: str, kind: Any, raw: str) -> Any:
    kind_name = kind if isinstance(kind, str) else kind.__name__
    if name in _DURATIONS:
        try:
            return parse_duration_ms(raw)
        except ConfigurationError:
            raise ConfigurationError(f"AX_{name.upper()}={raw!r} is not a duration "
                                     "(e.g. 7d, 12h; unset: off)") from None
    try:
        if kind_name == "bool":
            if raw.lower() not in {"1", "0", "true", "false", "yes", "no", "on", "off"}:
                raise ValueError(raw)
            return raw.lower() in {"1", "true", "yes", "on"}
        if kind_name == "int":
            return parse_duration_ms(raw) if name.endswith("_ms") and not raw.isdigit() else int(raw)
        if kind_name == "float":
            return float(raw)
    except ValueError:
        raise ConfigurationError(f"AX_{name.upper()}={raw!r} is not a valid {kind_name}") from None
    return raw


def from_env(environ: Mapping[str, str] | None = None, /, **overrides: Any) -> Settings:
    """Defaults, then ``AX_*`` variables from ``environ``, then ``overrides``."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(Settings):
        raw = environ.get(f"AX_{f.name.upper()}")
        if raw is not None:
            values[f.name] = _coerce(f.name, f.type, raw)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Settings().replace(**values)


#: a URL inside any text: scheme://… up to whitespace or a quote. The scheme is bounded
#: (RFC 3986 sets no limit; real ones are short): unbounded, every letter of a long run
#: without ``://`` started a scan to the run's end, quadratic (16 k letters took 0.18 s).
#: A longer scheme is matched by its last 32 characters, which redacts the same.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,31}://[^\s'\"<>]*")
#: ``user:password@``, up to the first ``@`` after the colon; searched only up to the last
#: ``@`` of the URL (see :func:`_hide_userinfo`)
_USERINFO = re.compile(r"(://[^:/@]*:)[^@]*@")
#: one ``key=value`` of a query string
_QUERY_PAIR = re.compile(r"(^|[&;])([^=&;]*)=([^&;]*)")
#: query keys whose values are never secret and help an operator (TLS mode, timeouts)
SAFE_QUERY_KEYS = frozenset({"sslmode", "ssl_cert_reqs", "ssl_check_hostname", "connect_timeout",
                             "application_name", "target_session_attrs", "heartbeat", "timeout",
                             "socket_timeout", "socket_connect_timeout", "ssl", "tls"})
#: ``password=…`` outside a URL (a libpq key/value DSN)
_KV_PASSWORD = re.compile(r"(\bpassword\s*=\s*)(?!\*\*\*)[^\s'\"&;,)]+", re.IGNORECASE)


def _redact_pair(match: re.Match[str]) -> str:
    sep, key, _value = match.groups()
    return match.group(0) if key.lower() in SAFE_QUERY_KEYS else f"{sep}{key}=***"


def _hide_userinfo(url: str) -> str:
    """``url`` with each ``user:password@`` hidden. Searched only up to the last ``@``:
    past it no match can end, and each ``://x:`` there would have cost a scan to the
    end of the URL (quadratic on a long one)."""
    last = url.rfind("@")
    if last < 0:
        return url
    return _USERINFO.sub(r"\1***@", url[:last + 1]) + url[last + 1:]


def _redact_one(match: re.Match[str]) -> str:
    url = _hide_userinfo(match.group(0))
    head, question, rest = url.partition("?")
    if not question:
        return url
    query, hash_, fragment = rest.partition("#")
    return f"{head}?{_QUERY_PAIR.sub(_redact_pair, query)}{hash_}{fragment}"


def redact_url(url: str) -> str:
    """``url`` safe for logs, CLI output and ``last_error``: any password and every
    query-string value (except :data:`SAFE_QUERY_KEYS`) replaced by ``***``.

    ``url`` may also be any text that contains URLs (a log line, an error message):
    each URL in it is redacted, and so is a ``password=…`` pair outside a URL::

        >>> redact_url("redis://:pw@h:6379/0 and https://x/cb?token=t&sslmode=require")
        'redis://:***@h:6379/0 and https://x/cb?token=***&sslmode=require'
    """
    return _KV_PASSWORD.sub(r"\1***", _URL_IN_TEXT.sub(_redact_one, url))
