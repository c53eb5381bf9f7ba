"""``ax archive`` under load: 1,000,000 finished rows moved while a steady load runs.

One ``ax-scheduler`` and one ``ax-worker`` (as in :mod:`bench.e2e`, PostgreSQL scratch
database + Redis) serve a producer enqueueing RATE no-op tasks/s (delays 0.05–30 s,
:mod:`bench.produce`). The hot table is first filled with ROWS finished tasks created 30
days ago (one bulk ``INSERT … SELECT generate_series``; every 10th with an ``ax_attempt``
row). After a warm-up, windows alternate: a baseline window of WINDOW s with nothing else
running, then ``ax archive --older-than 7d --limit ROWS/PARTS`` (a real subprocess, default
batch), and so on, ending with a baseline window; the last archive run takes what is left.

Figures: start − trigger p50/p99 of the steady tasks whose trigger time falls in the
baseline windows and in the archive windows (each pooled, and per window), as each task's
body recorded it (its own wall clock, :mod:`bench.ledger`; not ``started_at``, which a
staged task gets as its trigger time by construction), tasks that ran twice or started
early, and each archive run's rate (tasks/s, as it reports).

    .venv/bin/python -m bench.archive [--rows 1000000 --rate 1000 --parts 4 --window 30]
                                      [--pause 20ms] [-c high=8,default=64,slow=8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.config import Settings, from_env
from ax_kombu.core.ids import EPOCH_MS
from ax_kombu.store.engine import make_engine

from . import ledger
from .common import machine, pct, scratch_database
from .e2e import ROOT, _cleanup_redis, _env, daemons, scalar, wait_ready

DAY = 86_400_000
#: a task's delay is at most 30 s (bench.produce): triggers reach the full rate after it
WARMUP_S = 32.0

_FILL_TASKS = """
INSERT INTO ax_task (task_id, task_type, trigger_time, status, priority, retry_count,
    max_retry, timeout_ms, processor_name, payload, fingerprint, trace_id, attempt,
    owner_node, created_at, dispatched_at, started_at, finished_at, redispatches, gated,
    result)
SELECT ((CAST(:base AS BIGINT) + i - :epoch) << 22) | (1023 << 12), 'bench.old', :base + i,
    CASE WHEN i % 50 = 0 THEN 'FAILED' ELSE 'SUCCESS' END, 'default', 0, 3, 60000,
    'bench.old', '{"i": ' || i || '}', md5(i::text), md5((-i)::text), 2, 'old-worker',
    :base + i, :base + i + 1, :base + i + 2, :base + i + 5, 0, false,
    CASE WHEN i % 50 = 0 THEN NULL ELSE '{"ok": true}' END
FROM generate_series(0, :n - 1) AS i
"""
_FILL_ATTEMPTS = """
INSERT INTO ax_attempt (task_id, attempt, task_type, node, trigger_time, dispatched_at,
    started_at, finished_at, outcome, error, duration_ms)
SELECT ((CAST(:base AS BIGINT) + i - :epoch) << 22) | (1023 << 12), 1, 'bench.old',
    'old-worker', :base + i, :base + i, :base + i + 1, :base + i + 1, 'RETRY', 'boom', 0
FROM generate_series(0, :n - 1, 10) AS i
"""


def fill(url: str, rows: int) -> float:
    """``rows`` finished tasks created 30 days ago, then VACUUM ANALYZE; returns seconds."""
    started = time.monotonic()
    engine = make_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        base = int(conn.execute(text("SELECT CAST(EXTRACT(EPOCH FROM now()) * 1000 AS BIGINT)"))
                   .scalar_one()) - 30 * DAY
        for sql in (_FILL_TASKS, _FILL_ATTEMPTS):
            conn.execute(text(sql), {"base": base, "epoch": EPOCH_MS, "n": rows})
        conn.execute(text("VACUUM ANALYZE ax_task, ax_attempt"))
    engine.dispose()
    return time.monotonic() - started


def _ax() -> list[str]:
    script = Path(sys.executable).parent / "ax"
    return [str(script)] if script.exists() else [
        sys.executable, "-c", "from ax_kombu.cli import main; main()"]


def archive_run(settings: Settings, limit: int | None, pause: str) -> dict[str, Any]:
    """One ``ax archive --older-than 7d --pause P [--limit N] --json`` to its end."""
    args = [*_ax(), "archive", "--older-than", "7d", "--pause", pause, "--json"]
    if limit is not None:
        args += ["--limit", str(limit)]
    done = subprocess.run(args, env=_env(settings), capture_output=True, text=True,
                          check=True, timeout=3600)
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def windows(client: Client, settings: Settings, args: argparse.Namespace
            ) -> list[tuple[str, int, int, dict[str, Any] | None]]:
    """Baseline and archive windows in turn: ``(kind, start_ms, end_ms, figures)``; the
    figures hold the machine's 1-minute load average at the window's end (other work on
    the machine shows there) and, for an archive window, what ``ax archive`` reported."""
    found: list[tuple[str, int, int, dict[str, Any] | None]] = []
    for part in range(args.parts + 1):
        start = client.store.now_ms()
        time.sleep(args.window)
        found.append(("baseline", start, client.store.now_ms(),
                      {"load1": round(os.getloadavg()[0], 1)}))
        if part == args.parts:
            break
        start = client.store.now_ms()
        last = part == args.parts - 1
        ran = archive_run(settings, None if last else args.rows // args.parts, args.pause)
        ran["load1"] = round(os.getloadavg()[0], 1)
        found.append(("archive", start, client.store.now_ms(), ran))
        print(f"  archive {part + 1}/{args.parts}: {ran}", flush=True)
    return found


def lateness(client: Client, entries: list[ledger.Entry], start: int, end: int
             ) -> tuple[list[float], int]:
    """start − trigger (ms) of the steady tasks due in [start, end), as their bodies recorded
    them (:mod:`bench.ledger`: the body's own wall clock against the trigger time; the
    database is on this host, so its clock is the wall clock), and how many tasks due in
    the window left no entry (never ran)."""
    late = [e.lateness_ms for e in entries if start <= e.due_ms < end]
    due = scalar(client, "SELECT count(*) FROM ax_task WHERE task_type = 'bench.steady' "
                         "AND trigger_time >= :s AND trigger_time < :e", s=start, e=end)
    return late, max(0, due - len(late))


def wait_started(client: Client, until_ms: int, deadline_s: float = 300.0) -> None:
    """Poll until every steady task due before ``until_ms`` has started (or the deadline)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and scalar(
            client, "SELECT count(*) FROM ax_task WHERE task_type = 'bench.steady' "
                    "AND trigger_time < :u AND started_at IS NULL", u=until_ms) > 0:
        time.sleep(1.0)


def summary(client: Client, entries: list[ledger.Entry],
            found: list[tuple[str, int, int, dict[str, Any] | None]]) -> dict[str, Any]:
    pooled: dict[str, list[float]] = {"baseline": [], "archive": []}
    per_window = []
    for kind, start, end, ran in found:
        late, unstarted = lateness(client, entries, start, end)
        pooled[kind] += late
        per_window.append({"kind": kind, "seconds": round((end - start) / 1000, 1),
                           "tasks": len(late), "unstarted": unstarted,
                           "p50_ms": pct(late, 50), "p99_ms": pct(late, 99),
                           "load1": ran["load1"] if ran else None,
                           **({"archived": ran["tasks"], "archive_rate_per_s":
                               round(ran["tasks"] / max(ran["seconds"], 1e-3))}
                              if kind == "archive" and ran else {})})
    runs = [ran for kind, _, _, ran in found if kind == "archive" and ran]
    archived = sum(ran["tasks"] for ran in runs)
    archive_s = sum(ran["seconds"] for ran in runs)
    base, during = pooled["baseline"], pooled["archive"]
    return {"archived": archived, "archive_rate_per_s": round(archived / archive_s),
            "baseline_tasks": len(base), "baseline_p50_ms": pct(base, 50),
            "baseline_p99_ms": pct(base, 99), "archive_tasks": len(during),
            "archive_p50_ms": pct(during, 50), "archive_p99_ms": pct(during, 99),
            "p99_ratio": round(pct(during, 99) / max(pct(base, 99), 1), 2),
            "windows": per_window}


def run(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    print(f"filled {args.rows} finished rows in {fill(settings.database_url, args.rows):.0f} s",
          flush=True)
    client = Client(settings)
    with daemons(settings, args) as procs:
        wait_ready(client, procs)
        producer = subprocess.Popen([sys.executable, "-m", "bench.produce", str(args.rate),
                                     "36000"], env=_env(settings), cwd=ROOT,
                                    stdout=subprocess.DEVNULL)
        try:
            time.sleep(WARMUP_S)
            found = windows(client, settings, args)
        finally:
            producer.send_signal(signal.SIGTERM)
            producer.wait(30)
        wait_started(client, found[-1][2])
    entries = ledger.read(redis.Redis.from_url(settings.broker_url), os.environ[ledger.KEY_VAR])
    runs = Counter(e.i for e in entries)
    result = summary(client, entries, found)
    result["ran_twice"] = sum(1 for n in runs.values() if n > 1)
    result["started_early"] = sum(1 for e in entries if e.lateness_ms < 0)
    result["left_in_hot_table"] = scalar(client, "SELECT count(*) FROM ax_task "
                                                 "WHERE task_type = 'bench.old'")
    client.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="finished rows to archive")
    parser.add_argument("--rate", type=int, default=1000, help="steady tasks/s enqueued")
    parser.add_argument("--parts", type=int, default=4, help="archive runs, between baselines")
    parser.add_argument("--window", type=float, default=30.0, help="baseline window, seconds")
    parser.add_argument("--pause", default="0", help="ax archive --pause (e.g. 20ms)")
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--concurrency", "-c", default=None, help="worker -c (default: ax's)")
    parser.add_argument("--prefetch-multiplier", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="SETTING=VALUE")
    parser.add_argument("--logs", default=f"/tmp/ax-bench-archive-{os.getpid()}")
    args = parser.parse_args()
    with scratch_database("ax_bench_archive") as url:
        settings = from_env({}, database_url=url, broker_url=args.broker,
                            broker_key_prefix=f"axarch{os.getpid()}:")
        # the worker's steady body records its own start here (bench.e2e.steady_body)
        os.environ[ledger.URL_VAR] = args.broker
        os.environ[ledger.KEY_VAR] = f"{settings.broker_key_prefix}ledger"
        try:
            result = run(settings, args)
        finally:
            _cleanup_redis(settings)
    per_window = result.pop("windows")
    print(f"archive under a steady {args.rate}/s (1 scheduler + 1 worker, {args.rows} rows in "
          f"{args.parts} runs, --pause {args.pause}, {args.window:.0f} s baselines) on "
          f"{machine()}: "
          + ", ".join(f"{k}={v}" for k, v in result.items()))
    for w in per_window:
        print("  " + ", ".join(f"{k}={v}" for k, v in w.items()))


if __name__ == "__main__":
    main()
