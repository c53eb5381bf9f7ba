"""Every Prometheus metric ax exports, in one place.

The key user-facing figure is ``ax_schedule_delay_seconds``: publish time
minus the task's trigger time. The shipped alert rules
(``deploy/prometheus/ax-alerts.yml``) page on it, and the Grafana dashboard
(``deploy/grafana/ax-dashboard.json``) opens with it; a unit test checks that
every metric those files name is defined here, so rename nothing.

Label values stay few: ``queue`` is a priority (high, default, slow), and a
task's type becomes a label only through :func:`type_label`, which reports
types outside the ``AX_METRICS_TASK_TYPES`` allow-list as ``"other"``.

Under ``ax-worker --processes N`` the children write these metrics in
prometheus_client's multiprocess mode and the supervisor serves their merge
(:mod:`ax_kombu.worker.supervisor`): counters and histograms are summed over
the children, and each gauge says how its children's values combine
(``multiprocess_mode``; ``live…``: only running children count). The mode is
ignored in a single process.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
from bisect import bisect_left
from collections.abc import Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    make_wsgi_app,
)

from ax_kombu.observability.probes import Probe, wsgi_app

_FINE = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
         60.0, 300.0)

schedule_delay = Histogram("ax_schedule_delay_seconds",
                           "Publish time minus trigger time of each dispatched task (0 when "
                           "staged ahead), by queue.", ["queue"], buckets=_FINE)
schedule_batch_size = Histogram("ax_schedule_batch_size", "Tasks claimed per claim statement.",
                                buckets=(1, 5, 10, 50, 100, 250, 500, 1000, 2500, 5000))
wheel_queue_depth = Gauge("ax_wheel_queue_depth", "Tasks loaded in the scheduler's memory (timing wheel and delay queue).",
                          ["layer"], multiprocess_mode="livesum")
dispatch_total = Counter("ax_dispatch_total", "Dispatch outcomes per task.", ["result"])
dispatch_latency = Histogram("ax_dispatch_latency_seconds",
                             "Time to claim and publish one batch.", buckets=_FINE)
ack_timeout_total = Counter("ax_ack_timeout_total",
                            "Tasks returned to READY because no worker started them in time.")
preload_total = Counter("ax_preload_total", "Tasks taken into memory by the preload.")
due_pruned_total = Counter("ax_due_pruned_total",
                           "ax_due entries deleted after their task moved on.")
recovered_total = Counter("ax_recovered_total", "Tasks recovered from dead nodes.", ["kind"])
clock_skew = Gauge("ax_clock_skew_seconds", "This node's clock offset to the database clock.",
                   multiprocess_mode="liveall")
clock_steps_total = Counter("ax_clock_steps_total",
                            "Steps of the wall clock noticed (database time is unaffected).")
housekeeping_errors_total = Counter(
    "ax_housekeeping_errors_total",
    "Failed steps of the scheduler's housekeeping, by step (jobs, preload, judge, recovery, "
    "overdue, prune; beat: the heartbeat's own thread): each is logged with its reason and "
    "backed off; none stops the heartbeat or the process.", ["step"])
fenced_total = Counter("ax_node_fenced_total",
                       "Times this process learned it had been declared dead and re-registered.")
redispatch_failed_total = Counter("ax_redispatch_failed_total",
                                  "Tasks failed after AX_MAX_DISPATCHES dispatches without a start.")
job_occurrences_total = Counter("ax_job_occurrences_total",
                                "Occurrences of recurring jobs written as tasks by this scheduler "
                                "(catch-ups after a misfire included).")
job_misfires_total = Counter("ax_job_misfires_total",
                             "Occurrences of recurring jobs missed while no scheduler ran them, "
                             "by what the job's misfire policy did with them.", ["action"])
gate_total = Counter("ax_gate_total",
                     "Gated tasks (order key, limit, job strategy) by what the gated claim did: "
                     "start, wait (parked), cancel (discard), supersede (cover).", ["action"])
execute_total = Counter("ax_execute_total",
                        "Task runs by outcome: result is success, error, timeout, abandoned, "
                        "or what the processor raised: retry (ax.Retry), snooze (ax.Snooze), "
                        "discard (ax.Discard); task_type: see type_label.",
                        ["queue", "result", "task_type"])
execute_duration = Histogram("ax_execute_duration_seconds", "Run time of one task.", ["queue"],
                             buckets=_FINE)
start_delay = Histogram("ax_start_delay_seconds", "Start time minus trigger time.",
                        buckets=_FINE)
retry_count = Histogram("ax_retry_count", "retry_count of tasks when they finish.",
                        buckets=(0, 1, 2, 3, 5, 8, 13))
stale_messages_total = Counter("ax_stale_messages_total",
                               "Messages refused by a worker (stale attempt or cancelled).")
rejected_messages_total = Counter(
    "ax_rejected_messages_total",
    "Messages a worker refused as hostile or malformed, each counted once, by reason "
    "(ax_kombu.broker.rejects.REASONS; 'forged' for a message contradicting its task row).",
    ["reason"])
node_up = Gauge("ax_node_up",
                "1 while this daemon runs, by kind: scheduler or worker (set by ax-scheduler / "
                "ax-worker at start; the series goes away with the process; under ax-worker "
                "--processes, the live children's count).", ["kind"], multiprocess_mode="livesum")
execute_timeout_total = Counter(
    "ax_execute_timeout_total",
    "Runs that overran their timeout_ms, counted when their outcome is recorded (the run's "
    "thread has returned), with ax_execute_total{result=\"timeout\"}; a run still stuck "
    "past its timeout shows in the worker's heartbeat as overdue.")
dedup_total = Counter(
    "ax_dedup_total",
    "Enqueued tasks not created because they duplicate an existing one, by kind: biz_key "
    "(same task_type and biz_key) or fingerprint (same fingerprint within the dedup window).",
    ["kind"])
oldest_overdue = Gauge(
    "ax_oldest_overdue_seconds",
    "Database time minus the trigger time of the oldest task that is due and not started "
    "(CREATED, DELAYED, READY or DISPATCHING, parked gated tasks excluded); 0 when none is "
    "overdue.",
    multiprocess_mode="livemax")
pool_size = Gauge("ax_pool_size", "Slots (threads) of this worker's pool for a queue.", ["queue"],
                  multiprocess_mode="livesum")
pool_busy = Gauge("ax_pool_busy",
                  "Slots of this worker's pool for a queue taken by a run (stuck runs included).",
                  ["queue"], multiprocess_mode="livesum")
pool_prefetched = Gauge(
    "ax_pool_prefetched",
    "Messages this worker has received from the broker for a queue and not acked yet "
    "(running, or waiting in the lane's backlog for a slot).", ["queue"],
    multiprocess_mode="livesum")
paused = Gauge(
    "ax_paused",
    "1 for each task type (kind=\"type\") and queue (kind=\"queue\") paused cluster-wide, "
    "as this scheduler last read them (ax pause-type, ax queues pause); their tasks wait, "
    "and count in ax_oldest_overdue_seconds.", ["kind", "name"], multiprocess_mode="livemax")
queue_waiting_without_consumer = Gauge(
    "ax_queue_waiting_without_consumer",
    "Tasks READY or DISPATCHING for a queue that no live worker consumes (0 when some worker "
    "consumes it).", ["queue"], multiprocess_mode="livemax")

#: the variable naming the task types that may appear as a ``task_type`` label value
TASK_TYPES_ENV = "AX_METRICS_TASK_TYPES"
#: the label value of every task type outside the allow-list
OTHER_TYPE = "other"


def type_label(task_type: str) -> str:
    """The ``task_type`` label value for ``task_type``: itself if allowed, else ``"other"``.

    Each label value is a time series kept in every process and in Prometheus,
    so task types are labels only where listed: ``AX_METRICS_TASK_TYPES`` is a
    comma-separated allow-list (e.g. ``email.send,report.build``). Unset or
    empty, every type is reported as ``"other"``. The variable is read on each
    call (its parsing is cached), so a test may change it.
    """
    allowed = _allowed_types(os.environ.get(TASK_TYPES_ENV, ""))
    return task_type if task_type in allowed else OTHER_TYPE


@functools.lru_cache(maxsize=8)
def _allowed_types(text: str) -> frozenset[str]:
    return frozenset(name.strip() for name in text.split(",") if name.strip())


def observe_many(histogram: Any, values: Iterable[float]) -> None:
    """Observe each of ``values``, as many ``observe`` calls would, in one pass.

    A worker observes several histograms per task, thousands of times a
    second; ``Histogram.observe`` takes two locks and walks the buckets in
    Python each time. This counts a batch per bucket first, then increments
    each bucket touched and the sum once. It relies on the histogram's bucket
    list (``_upper_bounds``, ``_buckets``, ``_sum``, unchanged in
    prometheus_client since 0.4) and falls back to ``observe`` without it.
    ``histogram`` is a histogram without labels or a labelled child.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    if bounds is None or not hasattr(histogram, "_buckets") or not hasattr(histogram, "_sum"):
        for value in values:
            histogram.observe(value)
        return
    histogram._raise_if_not_observable()
    counts = [0] * len(bounds)
    total = 0.0
    for value in values:
        counts[bisect_left(bounds, value)] += 1  # the first bound >= value, as observe finds
        total += value
    histogram._sum.inc(total)
    for bucket, count in zip(histogram._buckets, counts, strict=True):
        if count:
            bucket.inc(count)


def serve(port: int, addr: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY,
          probe: Probe | None = None) -> WSGIServer | None:
    """Serve ``registry`` (this process's metrics by default) on ``addr:port`` (0 disables),
    and ``probe``'s ``/healthz`` and ``/readyz`` (:mod:`ax_kombu.observability.probes`;
    without a probe both say the process is serving).

    The metrics answer at ``/metrics`` and, as prometheus_client's own server did, at any
    other path. Each request runs on a thread of its own (daemon threads).

    Returns:
        The running server (``shutdown()`` then ``server_close()`` stops it), or None when
        disabled.
    """
    if not port:
        return None
    app = wsgi_app(probe if probe is not None else Probe(), make_wsgi_app(registry))

    class Server(_ThreadingServer):
        # IPv4 or IPv6, as the address is (``::`` binds every interface of both)
        address_family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                            flags=socket.AI_PASSIVE)[0][0]

    server = make_server(addr, port, app, Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="ax-metrics-http", daemon=True).start()
    return server


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """A thread per request; the threads do not keep the process alive."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """Logs no line per request (a scrape or a probe every few seconds)."""

    def log_message(self, format: str, *args: Any) -> None:
        """Nothing."""
