"""The Prometheus endpoints of real daemons count what really happened.

One ``ax-scheduler`` and one ``ax-worker`` run as real processes, each with
``--metrics-port`` on a free loopback port. The test enqueues a known mix —
tasks that succeed, tasks that fail without retries, tasks that overrun their
``timeout_ms``, and duplicates by ``biz_key`` and by fingerprint — waits until
every task is final in the store, then scrapes both ``/metrics`` over HTTP and
checks each count against what the store (and the processor's run log) says
happened:

* scheduler: ``ax_dispatch_total{result="ok"}`` and
  ``ax_schedule_delay_seconds_count`` equal the dispatches (sum of the rows'
  ``attempt``), no ``failed`` dispatch, ``ax_node_up{kind="scheduler"} == 1``,
  ``ax_oldest_overdue_seconds`` present and 0 once all is done;
* worker: ``ax_execute_total`` per (queue, result) equals the runs by priority
  and outcome (success / error / timeout, as ``worker.results._observe`` labels
  them), ``ax_execute_duration_seconds_count`` per queue and
  ``ax_start_delay_seconds_count`` equal the runs, ``ax_retry_count_count``
  the finished tasks, ``ax_execute_timeout_total == 3``,
  ``ax_node_up{kind="worker"} == 1``, and ``ax_pool_size`` / ``ax_pool_busy`` /
  ``ax_pool_prefetched`` present for each lane (size as ``-c`` says, nothing
  busy or staged at the end);
* producer (this process, whose :class:`~ax_kombu.api.Client` enqueued):
  ``ax_dedup_total`` by kind grew by the duplicates, read from
  ``prometheus_client.REGISTRY`` (no endpoint serves it).

Counters are incremented just after the store write they follow (the worker
counts a batch of results once it committed), so each scrape is polled until
it settles, then compared for equality.
"""

from __future__ import annotations

import socket
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from ..ledger import Ledger
from .system import System

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(90)]

PRIORITIES = ("high", "default", "slow")
POOLS = {"high": 4, "default": 3, "slow": 2}
N_OK, N_FAIL, N_TIMEOUT, N_DUP_BIZ, N_DUP_FP = 40, 5, 3, 2, 2
TIMEOUT_MS, OVERRUN_S = 300, 1.2

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def system(pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> Iterator[System]:
    ax = System(pg_url, redis_broker, tmp_path)
    yield ax
    ax.close()


def free_port() -> int:
    """A loopback port nothing listens on (the OS picks it for a socket bound to 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> Samples:
    """Every sample of ``http://127.0.0.1:port/metrics``, by (name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
        body = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over every series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def series(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {ls: v for (n, ls), v in samples.items() if n == name}


def try_scrape(port: int) -> Samples | None:
    try:
        return scrape(port)
    except OSError:
        return None


def settled(system: System, port: int, check: Callable[[Samples], bool], what: str,
            timeout: float = 10.0) -> Samples:
    """Scrape ``port`` until ``check`` is true of the samples; the last scrape otherwise
    fails the test with it in the message."""
    last: list[Samples | None] = [None]

    def attempt() -> Samples | None:
        last[0] = try_scrape(port)
        return last[0] if last[0] is not None and check(last[0]) else None

    return system.wait_for(attempt, timeout, what, detail=lambda: last[0])  # type: ignore[no-any-return]


def dedup(kind: str) -> float:
    return REGISTRY.get_sample_value("ax_dedup_total", {"kind": kind}) or 0.0


def test_scraped_counts_equal_what_happened(system: System, tmp_path: Path) -> None:
    started = time.monotonic()
    log = Ledger(tmp_path / "runs.jsonl")
    sched_port, worker_port = free_port(), free_port()
    metrics_args = ["--metrics-port", "{}", "--metrics-addr", "127.0.0.1"]
    system._start("scheduler", "sched-0",
                  [a.format(sched_port) for a in metrics_args], None)
    system.worker("worker-0", concurrency=",".join(f"{q}={n}" for q, n in POOLS.items()),
                  args=[a.format(worker_port) for a in metrics_args])
    system.wait_ready()

    # both endpoints up; the pool gauges appear at the worker's first heartbeat (0.5 s)
    sched = settled(system, sched_port,
                    lambda s: value(s, "ax_node_up", kind="scheduler") is not None,
                    "the scheduler's /metrics serving")
    assert value(sched, "ax_node_up", kind="scheduler") == 1
    assert value(sched, "ax_oldest_overdue_seconds") is not None, "set at each scheduler beat"
    worker = settled(system, worker_port,
                     lambda s: all(value(s, "ax_pool_size", queue=q) is not None
                                   for q in PRIORITIES),
                     "the worker's pool gauges set by a heartbeat")
    assert value(worker, "ax_node_up", kind="worker") == 1

    def item(i: int, priority: str, **payload: Any) -> dict[str, Any]:
        return {"task_type": "e2e.task", "payload": {"log": str(log), "i": i, **payload},
                "delay": 0.2, "priority": priority, "max_retry": 0}

    ok = [item(i, PRIORITIES[i % 3]) for i in range(N_OK)]
    ok[0]["biz_key"] = "order-0"  # the originals of the duplicates below
    fail = [item(100 + i, PRIORITIES[i % 3], fail=1) for i in range(N_FAIL)]
    slow = [{**item(200 + i, PRIORITIES[i % 3], sleep=OVERRUN_S), "timeout_ms": TIMEOUT_MS}
            for i in range(N_TIMEOUT)]
    biz_before, fp_before = dedup("biz_key"), dedup("fingerprint")
    ids = system.enqueue_many(ok + fail + slow)
    assert len(set(ids)) == N_OK + N_FAIL + N_TIMEOUT
    for _ in range(N_DUP_BIZ):  # another payload, the same (task_type, biz_key)
        dup = system.client.enqueue(**{**ok[0], "payload": {"other": True}})
        assert (int(dup), dup.created) == (ids[0], False)
    for _ in range(N_DUP_FP):  # the same type and payload within dedup_window_ms
        dup = system.client.enqueue(**ok[1])
        assert (int(dup), dup.created) == (ids[1], False)
    assert (dedup("biz_key") - biz_before, dedup("fingerprint") - fp_before) \
        == (N_DUP_BIZ, N_DUP_FP)

    system.wait_final(len(ids), 30)

    # -- what happened, from the store (and the processor's own log) --------------------------
    rows = system.tasks()
    assert sorted(rows) == sorted(ids), "a duplicate was created"
    assert not system.query("SELECT task_id FROM ax_attempt"), "no attempt should have retried"
    dispatches = sum(r.attempt for r in rows.values())
    ran = [r for r in rows.values() if r.started_at is not None]

    def outcome(row: Any) -> str:
        if row.status == "SUCCESS":
            return "success"
        if (row.last_error or "").startswith("timed out after"):
            return "timeout"
        return "error"

    runs = Counter((r.priority, outcome(r)) for r in ran)
    by_result = Counter(result for _, result in runs.elements())
    assert by_result == {"success": N_OK, "error": N_FAIL, "timeout": N_TIMEOUT}, rows
    assert dispatches == len(ran) == len(log.runs()) == len(ids)
    assert Counter(r.status for r in rows.values()) == {"SUCCESS": N_OK,
                                                        "FAILED": N_FAIL + N_TIMEOUT}

    # -- the scheduler's endpoint ------------------------------------------------------------
    sched = settled(system, sched_port,
                    lambda s: (total(s, "ax_dispatch_total") >= dispatches
                               and value(s, "ax_oldest_overdue_seconds") == 0),
                    "the scheduler's counters caught up, nothing overdue")
    assert value(sched, "ax_dispatch_total", result="ok") == dispatches, series(
        sched, "ax_dispatch_total")
    assert not value(sched, "ax_dispatch_total", result="failed")
    assert total(sched, "ax_schedule_delay_seconds_count") == dispatches  # over the queues
    assert value(sched, "ax_node_up", kind="scheduler") == 1
    assert value(sched, "ax_oldest_overdue_seconds") == 0
    assert value(sched, "ax_ack_timeout_total") == 0
    assert value(sched, "ax_redispatch_failed_total") == 0

    # -- the worker's endpoint ---------------------------------------------------------------
    def worker_done(s: Samples) -> bool:
        return (total(s, "ax_execute_total") >= len(ran)
                and all(value(s, "ax_pool_busy", queue=q) == 0
                        and value(s, "ax_pool_prefetched", queue=q) == 0 for q in PRIORITIES))

    worker = settled(system, worker_port, worker_done,
                     "the worker's counters caught up, every pool idle")
    scraped = {(dict(ls)["queue"], dict(ls)["result"]): v
               for ls, v in series(worker, "ax_execute_total").items()}
    assert scraped == runs, (scraped, runs)
    assert total(worker, "ax_execute_total") == len(ran)
    for result, count in by_result.items():
        assert total(worker, "ax_execute_total", result=result) == count, result
    assert value(worker, "ax_execute_timeout_total") == N_TIMEOUT
    for q in PRIORITIES:
        assert value(worker, "ax_execute_duration_seconds_count", queue=q) \
            == sum(n for (p, _), n in runs.items() if p == q), q
        assert value(worker, "ax_pool_size", queue=q) == POOLS[q], q
        assert value(worker, "ax_pool_busy", queue=q) == 0, q
        assert value(worker, "ax_pool_prefetched", queue=q) == 0, q
    assert value(worker, "ax_start_delay_seconds_count") == len(ran)
    assert value(worker, "ax_retry_count_count") == len(rows)  # each task finished once
    assert value(worker, "ax_node_up", kind="worker") == 1
    assert value(worker, "ax_stale_messages_total") == 0
    assert not series(worker, "ax_rejected_messages_total")

    # nothing more was counted after the counts settled
    time.sleep(0.6)  # past another heartbeat of each daemon
    again_s, again_w = scrape(sched_port), scrape(worker_port)
    assert total(again_s, "ax_dispatch_total") == dispatches
    assert total(again_w, "ax_execute_total") == len(ran)
    assert value(again_w, "ax_execute_timeout_total") == N_TIMEOUT
    print(f"\nmetrics scrape: {len(ids)} tasks, {dispatches} dispatches, runs {dict(runs)}, "
          f"{time.monotonic() - started:.1f} s")
