"""Issue 21's backlog check: a queue of minutes on one worker, counted from what ran, and
the alert rules tested on the metrics that run exported.

One ``ax-scheduler`` and one ``ax-worker -Q high,default,slow -c default=4`` (ack timeout
and everything else at their defaults), each with ``--metrics-port``, on a scratch
PostgreSQL database and a fresh Redis key prefix. N tasks of ``--ms`` ms each
(:func:`bench.ax_tasks.sleeper`: one ledger line per run, :mod:`bench.ledger`) are
enqueued due now; every 15 s both metrics endpoints are scraped, keeping
``ax_start_delay_seconds_bucket`` (summed over all labels but ``le``) and
``ax_oldest_overdue_seconds`` (the max, as the rule takes it), until all N are final.

The verdict: runs per task from the ledger (lost: none, twice: none), statuses, tasks
re-dispatched (attempt > 1, as :func:`bench.e2e.figures` counts them) and tasks FAILED
"never started" (AX_MAX_DISPATCHES reached). The recorded series become the promtool unit
test ``deploy/prometheus/ax-alerts.backlog.test.yml`` (one sample per scrape, 15 s apart),
which expects each alert that the series make fire (AxScheduleDelayHigh, P2, first) from
the scrape this module computes, checked against promtool; the run's JSON goes to
``bench/results/backlog-alerts-<UTC stamp>.json``.

    .venv/bin/python -m bench.backlog_alerts [--n 100000] [--ms 5] [--broker redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.config import Settings, from_env

from . import ledger
from .ax_tasks import SLEEP_TYPE
from .common import drop_redis_keys, machine, scratch_database
from .e2e import ROOT, _env, figures, scalar, spawned, wait_ready

PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "ax-alerts.yml"
TEST_FILE = PROMETHEUS / "ax-alerts.backlog.test.yml"
RESULTS = ROOT / "bench" / "results"
SCRAPE_S = 15
#: what the rules in ax-alerts.yml say: alert → (threshold, labels); all have ``for: 1m``
ALERTS = {"AxScheduleDelayHigh": (2.0, {"severity": "warning", "priority": "P2"}),
          "AxScheduleDelayCritical": (10.0, {"severity": "critical", "priority": "P1"}),
          "AxTasksOverdue": (10.0, {"severity": "warning", "priority": "P2"})}
FOR_S = 60
WINDOW_S = 60
NEVER_STARTED = "%never started%"


@dataclass
class Series:
    """One sample per scrape: the start-delay buckets by ``le`` and the oldest overdue."""

    buckets: dict[str, list[float]] = field(default_factory=dict)
    overdue: list[float] = field(default_factory=list)

    def add(self, buckets: dict[str, float], overdue: float) -> None:
        for le in buckets.keys() | self.buckets.keys():
            self.buckets.setdefault(le, [0.0] * len(self.overdue)).append(buckets.get(le, 0.0))
        self.overdue.append(overdue)


# -- scraping ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def scrape(ports: list[int]) -> tuple[dict[str, float], float]:
    """Both endpoints' start-delay buckets summed by ``le``, and their max oldest overdue."""
    buckets: dict[str, float] = {}
    overdue = 0.0
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            body = answer.read().decode()
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                if sample.name == "ax_start_delay_seconds_bucket":
                    le = sample.labels["le"]
                    buckets[le] = buckets.get(le, 0.0) + sample.value
                elif sample.name == "ax_oldest_overdue_seconds":
                    overdue = max(overdue, sample.value)
    return buckets, overdue


def final_count(client: Client) -> int:
    return int(scalar(client, "SELECT COUNT(*) FROM ax_task "
                              "WHERE status IN ('SUCCESS', 'FAILED', 'CANCELLED')"))


def record(client: Client, ports: list[int], n: int, timeout_s: float, series: Series,
           first_at: float) -> None:
    """Scrape every 15 s after ``first_at`` (the baseline scrape, monotonic) until ``n``
    tasks are final, then once more."""
    deadline = first_at + timeout_s
    next_at = first_at + SCRAPE_S
    done_seen = False
    while True:
        time.sleep(max(0.0, next_at - time.monotonic()))
        next_at += SCRAPE_S
        series.add(*scrape(ports))
        if done_seen or time.monotonic() > deadline:
            return
        done = final_count(client)
        print(f"  t={(len(series.overdue) - 1) * SCRAPE_S:>4}s final {done}/{n}, oldest "
              f"overdue {series.overdue[-1]:.1f}s", flush=True)
        done_seen = done >= n


# -- the verdict ------------------------------------------------------------------------------

def verdict(client: Client, entries: list[ledger.Entry], n: int) -> dict[str, Any]:
    """Runs per task from the ledger, statuses, re-dispatches and "never started" from rows."""
    runs = Counter(entry.i for entry in entries)
    with client.store.engine.connect() as conn:
        statuses = {status: int(count) for status, count in conn.execute(text(
            "SELECT status, COUNT(*) FROM ax_task GROUP BY status"))}
    never_started = scalar(client, "SELECT COUNT(*) FROM ax_task WHERE status = 'FAILED' "
                                   "AND last_error LIKE :pattern", pattern=NEVER_STARTED)
    rows = figures(client)
    return {"tasks": rows["tasks"], "statuses": statuses, "success": rows["success"],
            "ledger_runs": len(entries), "ran_once": sum(c == 1 for c in runs.values()),
            "ran_twice_or_more": sum(c > 1 for c in runs.values()),
            "lost": n - len(runs.keys() & set(range(n))),
            "redispatched": rows["redispatched"], "failed_never_started": int(never_started),
            "start_p50_ms": rows["start_p50_ms"], "start_p99_ms": rows["start_p99_ms"],
            "start_max_ms": rows["start_max_ms"]}


# -- the rules, evaluated on the series --------------------------------------------------------

def p99(buckets: dict[str, float]) -> float | None:
    """``histogram_quantile(0.99, …)`` of cumulative bucket increases (None: no starts)."""
    bounds = sorted((float(le), count) for le, count in buckets.items())
    total = bounds[-1][1] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = 0.99 * total, 0.0, 0.0
    for upper, count in bounds:
        if count >= rank:
            if upper == float("inf"):
                return lower  # Prometheus: the highest finite bound
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def active(series: Series, alert: str, i: int) -> bool:
    """Whether ``alert``'s expression holds at the evaluation of scrape ``i``: the delay
    rules on the increase over the samples in [t − 1m, t] (rate's extrapolation scales every
    bucket alike, so the quantile is the same), the overdue rule on the sample itself."""
    threshold = ALERTS[alert][0]
    if alert == "AxTasksOverdue":
        return series.overdue[i] > threshold
    first = max(0, i - WINDOW_S // SCRAPE_S)
    if first == i:
        return False
    value = p99({le: values[i] - values[first] for le, values in series.buckets.items()})
    return value is not None and value > threshold


def first_firing_s(series: Series, alert: str) -> int | None:
    """The first evaluation (seconds from the first scrape) at which ``alert`` fires: its
    expression held at every evaluation of the 1 m before it."""
    since = None
    for i in range(len(series.overdue)):
        if not active(series, alert, i):
            since = None
            continue
        since = i if since is None else since
        if (i - since) * SCRAPE_S >= FOR_S:
            return i * SCRAPE_S
    return None


# -- the promtool test -------------------------------------------------------------------------

def _fmt(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:.3f}"


def input_series(series: Series) -> list[str]:
    lines = [f"      - {{series: 'ax_start_delay_seconds_bucket{{le=\"{le}\"}}', values: "
             f"'{' '.join(_fmt(v) for v in values)}'}}"
             for le, values in sorted(series.buckets.items(), key=lambda kv: float(kv[0]))]
    lines.append(f"      - {{series: 'ax_oldest_overdue_seconds', values: "
                 f"'{' '.join(_fmt(v) for v in series.overdue)}'}}")
    return lines


def expectation(alert: str, at_s: int, annotations: dict[str, str] | None) -> list[str]:
    """An alert_rule_test entry: ``alert`` firing at ``at_s`` (silent if no annotations)."""
    if annotations is None:
        return [f"      - {{eval_time: {at_s}s, alertname: {alert}}}"]
    labels = ", ".join(f"{k}: {v}" for k, v in ALERTS[alert][1].items())
    notes = "".join(f"\n                {k}: {json.dumps(v)}" for k, v in sorted(annotations.items()))
    return [f"      - eval_time: {at_s}s", f"        alertname: {alert}",
            "        exp_alerts:", f"          - exp_labels: {{{labels}}}",
            f"            exp_annotations:{notes}"]


def test_yaml(series: Series, header: str, rules: str,
              expected: list[tuple[str, int, dict[str, str] | None]]) -> str:
    body = [line for alert, at_s, notes in expected for line in expectation(alert, at_s, notes)]
    return "\n".join([header, "rule_files:", f"  - {rules}", "evaluation_interval: 15s", "",
                      "tests:", "  - interval: 15s", "    input_series:",
                      *input_series(series), "    alert_rule_test:", *body, ""])


def promtool(path: Path) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    if tool is None:
        raise SystemExit("promtool is not on PATH")
    return subprocess.run([tool, "test", "rules", path.name], cwd=path.parent,
                          capture_output=True, text=True, timeout=120, check=False)


def promtool_firing(series: Series, alert: str, at_s: int) -> dict[str, str] | None:
    """What promtool says ``alert`` is at ``at_s``: None when silent (or pending), else the
    firing alert's annotations (read from the failure of a test expecting silence)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.test.yml"
        path.write_text(test_yaml(series, "", str(RULES), [(alert, at_s, None)]))
        done = promtool(path)
    if done.returncode == 0:
        return None
    said = done.stdout + done.stderr
    found = dict(re.findall(r'(summary|description)="((?:[^"\\]|\\.)*)"', said))
    if "summary" not in found:
        raise SystemExit(f"promtool failed unexpectedly:\n{said}")
    return {k: json.loads(f'"{v}"') for k, v in found.items()}


def confirm(series: Series, alert: str, computed_s: int | None) -> tuple[int | None, Any]:
    """The first eval time promtool shows ``alert`` firing, searched from the computed one
    (a step back while it fires, forward while it does not), and its annotations."""
    last = (len(series.overdue) - 1) * SCRAPE_S
    at_s = computed_s if computed_s is not None else last
    notes = promtool_firing(series, alert, at_s)
    while notes is not None and at_s > 0 and promtool_firing(series, alert, at_s - SCRAPE_S):
        at_s -= SCRAPE_S
        notes = promtool_firing(series, alert, at_s)
    while notes is None and at_s < last:
        if computed_s is None:
            return None, None
        at_s += SCRAPE_S
        notes = promtool_firing(series, alert, at_s)
    return (at_s, notes) if notes is not None else (None, None)


def write_test(series: Series, stamp: str, args: argparse.Namespace) -> dict[str, Any]:
    """Compute and confirm each alert's first firing, write :data:`TEST_FILE`, run it."""
    alerts: dict[str, Any] = {}
    expected: list[tuple[str, int, dict[str, str] | None]] = []
    for alert in ALERTS:
        computed = first_firing_s(series, alert)
        at_s, notes = confirm(series, alert, computed)
        alerts[alert] = {"computed_s": computed, "promtool_s": at_s}
        if at_s is not None:
            expected += [(alert, at_s - SCRAPE_S, None), (alert, at_s, notes)]
    header = (f"# Issue 21's backlog, recorded by `python -m bench.backlog_alerts --n {args.n} "
              f"--ms {args.ms}` ({stamp}, {machine()}):\n"
              "# one scrape of ax-scheduler and ax-worker -c default=4 every 15 s from the "
              "enqueue (buckets summed by le,\n# overdue the max). Each alert that fires is "
              "silent (pending) one evaluation before its first firing.\n"
              "# Run: promtool test rules ax-alerts.backlog.test.yml")
    TEST_FILE.write_text(test_yaml(series, header, RULES.name, expected))
    done = promtool(TEST_FILE)
    return {"alerts": alerts, "promtool_rc": done.returncode,
            "promtool_output": (done.stdout + done.stderr).strip()}


# -- the run ----------------------------------------------------------------------------------

def enqueue(client: Client, n: int, ms: int) -> int:
    """``n`` tasks due now (database clock), in bulk; returns their due time (epoch ms)."""
    due = client.store.now_ms()
    run_at = datetime.fromtimestamp(due / 1000, UTC)
    for base in range(0, n, 20_000):
        client.enqueue_many([{"task_type": SLEEP_TYPE, "run_at": run_at,
                              "payload": {"i": i, "due": due, "ms": ms}}
                             for i in range(base, min(n, base + 20_000))])
    return due


def run(settings: Settings, args: argparse.Namespace, key: str) -> dict[str, Any]:
    ports = [free_port(), free_port()]
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    env = {**_env(settings), ledger.URL_VAR: args.redis, ledger.KEY_VAR: key}
    specs = [("scheduler", "backlog-scheduler", ["-l", "WARNING", "--metrics-port", str(ports[0])]),
             ("worker", "backlog-worker", ["-Q", "high,default,slow", "-A", "bench.ax_tasks",
                                           "-c", "default=4", "-l", "WARNING",
                                           "--metrics-port", str(ports[1])])]
    client = Client(settings)
    series = Series()
    with spawned(specs, env, logs) as procs:
        wait_ready(client, procs)
        started = time.monotonic()
        series.add(*scrape(ports))
        due = enqueue(client, args.n, args.ms)
        print(f"enqueued {args.n} in {time.monotonic() - started:.1f}s", flush=True)
        record(client, ports, args.n, args.timeout, series, started)
    conn = redis.Redis.from_url(args.redis)
    last = scalar(client, "SELECT MAX(finished_at) FROM ax_task WHERE status = 'SUCCESS'")
    result = {"last_success_after_due_s": round((last - due) / 1000, 1), **verdict(client, ledger.read(conn, key), args.n)}
    conn.close()
    client.close()
    return {"result": result, "series": {"buckets": series.buckets, "overdue": series.overdue}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000, help="tasks, all due now")
    parser.add_argument("--ms", type=int, default=5, help="each task sleeps this")
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="the ledger's Redis")
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up after this (s)")
    parser.add_argument("--logs", default=f"/tmp/ax-bench-backlog-{os.getpid()}")
    args = parser.parse_args()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    prefix = f"axbacklog{os.getpid()}:"
    with scratch_database("ax_bench_backlog") as url:
        settings = from_env({}, database_url=url, broker_url=args.broker, broker_key_prefix=prefix)
        try:
            out = run(settings, args, prefix + "ledger")
        finally:
            for target in {args.broker, args.redis}:
                if target.startswith("redis"):
                    drop_redis_keys(target, prefix)
    out.update(stamp=stamp, machine=machine(),
               params={"n": args.n, "ms": args.ms, "broker": args.broker,
                       "worker": "-Q high,default,slow -c default=4"})
    saved = RESULTS / f"backlog-alerts-{stamp}.json"
    RESULTS.mkdir(exist_ok=True)
    saved.write_text(json.dumps(out, indent=1) + "\n")  # the run first, then its test
    out["tests"] = write_test(Series(**out["series"]), stamp, args)
    saved.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["result"], indent=1))
    print(json.dumps(out["tests"]["alerts"]), "\npromtool:", out["tests"]["promtool_output"])


if __name__ == "__main__":
    main()
