"""``ax web`` with 1,000,000 tasks: how long each console page takes to answer.

A scratch PostgreSQL database is filled with ROWS tasks created over the last 24 hours
(one bulk ``INSERT … SELECT generate_series``; snowflake ids made from each creation time,
as ax makes them), so the last hour holds ~ROWS/24 of them: 1 % FAILED (each with an
earlier attempt in ``ax_attempt``), 2 % CANCELLED, 5 % DELAYED (due in the next day), 1 %
READY and overdue, the rest SUCCESS; 20 task types, and the oldest 10 % of another
(``bench.old``, the worst case for "newest first"); every 10th task has a biz_key. Then
20 recurring jobs, 5 limits and two heartbeating nodes are added through the library, and
``VACUUM ANALYZE`` runs. A real ``ax web`` process (``python -m ax_kombu web``, Redis for
the queue depths) serves it; each page is fetched WARMUP times, then N times in turn over
HTTP on loopback, one request at a time; the figures are the wall-clock times of those
requests (client side: the whole answer read).

    .venv/bin/python -m bench.web_pages [--rows 1000000] [-n 20]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.config import Settings, from_env
from ax_kombu.core.ids import EPOCH_MS
from ax_kombu.store.engine import make_engine
from ax_kombu.store.nodes import Heartbeat

from .common import machine, median, pct, scratch_database
from .e2e import _env

DAY = 86_400_000
WARMUP = 3
TYPES = 20

_FILL_TASKS = """
INSERT INTO ax_task (task_id, task_type, trigger_time, status, priority, retry_count,
    max_retry, timeout_ms, processor_name, payload, biz_key, fingerprint, trace_id, attempt,
    owner_node, created_at, dispatched_at, started_at, finished_at, last_error,
    redispatches, gated)
SELECT ((c - :epoch) << 22) | ((i % 1024) << 12),
    CASE WHEN i < :n / 10 THEN 'bench.old' ELSE 'bench.type' || (i % :types) END,
    CASE WHEN i % 100 BETWEEN 3 AND 7 THEN :now + (i % 86400) * 1000 ELSE c + 1000 END,
    CASE WHEN i % 100 = 0 THEN 'FAILED' WHEN i % 100 IN (1, 2) THEN 'CANCELLED'
         WHEN i % 100 BETWEEN 3 AND 7 THEN 'DELAYED' WHEN i % 100 = 8 THEN 'READY'
         ELSE 'SUCCESS' END,
    (ARRAY['high', 'default', 'slow'])[i % 3 + 1], 0, 0, 60000, 'bench.p',
    '{"order": ' || i || ', "note": "<script>alert(1)</script>"}',
    CASE WHEN i % 10 = 0 THEN 'order-' || i END, md5(i::text), md5((-i)::text),
    CASE WHEN i % 100 BETWEEN 3 AND 8 THEN 0 ELSE 1 + (i % 100 = 0)::int END,
    CASE WHEN i % 100 BETWEEN 3 AND 8 THEN NULL ELSE 'worker-' || (i % 4) END, c,
    CASE WHEN i % 100 BETWEEN 3 AND 8 THEN NULL ELSE c + 1000 + i % 40 END,
    CASE WHEN i % 100 BETWEEN 3 AND 8 THEN NULL ELSE c + 1000 + i % 50 END,
    CASE WHEN i % 100 BETWEEN 3 AND 8 THEN NULL ELSE c + 1005 + i % 50 END,
    CASE WHEN i % 100 = 0 THEN 'RuntimeError: boom' END, 0, false
FROM (SELECT i, CAST(:base AS BIGINT) + i * :step AS c
      FROM generate_series(0, :n - 1) AS i) AS made
"""
_FILL_ATTEMPTS = """
INSERT INTO ax_attempt (task_id, attempt, task_type, node, trigger_time, dispatched_at,
    started_at, finished_at, outcome, error, duration_ms)
SELECT task_id, 1, task_type, 'worker-9', trigger_time, trigger_time, trigger_time + 2,
    trigger_time + 7, 'RETRY', 'RuntimeError: first try', 5
FROM ax_task WHERE status = 'FAILED'
"""


def fill(url: str, rows: int) -> float:
    """``rows`` tasks created over the last 24 hours (see the module docstring), then
    VACUUM ANALYZE; returns seconds."""
    started = time.monotonic()
    engine = make_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        now = int(conn.execute(text("SELECT CAST(EXTRACT(EPOCH FROM now()) * 1000 AS BIGINT)"))
                  .scalar_one())
        params = {"base": now - DAY, "step": DAY // rows, "epoch": EPOCH_MS, "n": rows,
                  "now": now, "types": TYPES}
        for sql in (_FILL_TASKS, _FILL_ATTEMPTS):
            conn.execute(text(sql), params)
    engine.dispose()
    return time.monotonic() - started


def decorate(client: Client) -> list[tuple[Heartbeat, dict[str, Any]]]:
    """20 jobs, 5 limits, and a scheduler and a worker that heartbeat (the caller beats)."""
    for j in range(20):
        client.schedule(f"report.{j}", f"bench.type{j}", {"j": j}, cron=f"{j} * * * *",
                        tz="Asia/Shanghai", processor="bench.p")
    for t in range(5):
        client.set_limit(f"bench.type{t}", 10 + t)
    info = {"queues": ["high", "default", "slow"], "pools": {"high": 8, "default": 16, "slow": 8},
            "free": {"high": 8, "default": 12, "slow": 8},
            "backlog": {"high": 0, "default": 30, "slow": 0}}
    beats = [(Heartbeat(client.store, "bench-sched", "scheduler"), {}),
             (Heartbeat(client.store, "bench-worker", "worker"), info)]
    for beat, said in beats:
        beat.register(said)
    engine = make_engine(client.settings.database_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text("VACUUM ANALYZE ax_task, ax_attempt, ax_job, ax_limit, ax_node"))
    engine.dispose()
    return beats


def pages(client: Client) -> dict[str, str]:
    """Each page measured, by label → path."""
    with client.store.engine.connect() as conn:
        failed = conn.execute(text("SELECT max(task_id) FROM ax_task WHERE status = 'FAILED'")
                              ).scalar_one()
        middle = conn.execute(text("SELECT task_id FROM ax_task ORDER BY task_id "
                                   "OFFSET (SELECT count(*) / 2 FROM ax_task) LIMIT 1")
                              ).scalar_one()
        biz = conn.execute(text("SELECT biz_key FROM ax_task WHERE biz_key IS NOT NULL "
                                "ORDER BY task_id LIMIT 1 OFFSET (SELECT count(biz_key) / 2 "
                                "FROM ax_task)")).scalar_one()
    hour_ago = datetime.fromtimestamp(time.time() - 3600, UTC).strftime("%Y-%m-%dT%H:%M")
    day_ago = datetime.fromtimestamp(time.time() - 20 * 3600, UTC).strftime("%Y-%m-%dT%H:%M")
    return {
        "overview (full page)": "/",
        "overview live fragment (the 3 s refresh)": "/overview/live",
        "tasks, no filter": "/tasks",
        "tasks, status=FAILED (1 %)": "/tasks?status=FAILED",
        "tasks, status=READY, a deep page": f"/tasks?status=READY&before={middle}",
        "tasks, type (1 of 20)": "/tasks?type=bench.type7",
        "tasks, type whose tasks are all old (the oldest 10 %)": "/tasks?type=bench.old",
        "tasks, type + status=CANCELLED": "/tasks?type=bench.type1&status=CANCELLED",
        "tasks, biz_key": f"/tasks?biz_key={biz}",
        "tasks, biz_key not found": "/tasks?biz_key=no-such-key",
        "tasks, id": f"/tasks?id={failed}",
        "tasks, created in an hour 20 h ago": f"/tasks?from={day_ago}&to={day_ago[:-2]}59",
        "tasks, created in the last hour, FAILED": f"/tasks?from={hour_ago}&status=FAILED",
        "task page (2 attempts)": f"/tasks/{failed}",
        "jobs (20, next 5 fires each)": "/jobs",
        "limits (5, running counts)": "/limits",
    }


def fetch(url: str) -> tuple[float, str]:
    """The page at ``url``: milliseconds to the end of its answer, and its text."""
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as reply:  # raises unless 2xx/3xx
        body = reply.read().decode()
    return (time.perf_counter() - started) * 1000, body


def measure(base: str, paths: dict[str, str], n: int,
            between: Callable[[], None]) -> dict[str, dict[str, float]]:
    found: dict[str, dict[str, float]] = {}
    for label, path in paths.items():
        between()
        for _ in range(WARMUP):
            fetch(base + path)
        answers = [fetch(base + path) for _ in range(n)]
        times = [ms for ms, _ in answers]
        found[label] = {"median_ms": round(median(times), 1), "p95_ms": round(pct(times, 95), 1),
                        "max_ms": round(max(times), 1),
                        "task_links": len(re.findall(r'href="/tasks/\d+"', answers[-1][1]))}
        print(f"  {label:<55} median {found[label]['median_ms']:7.1f} ms  "
              f"p95 {found[label]['p95_ms']:7.1f}  max {found[label]['max_ms']:7.1f}  "
              f"({found[label]['task_links']} task links)", flush=True)
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def serve(settings: Settings) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ax_kombu", "web", "--port", str(port)],
                            env=_env(settings), stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            fetch(base + "/limits")
            return proc, base
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("-n", type=int, default=20, help="requests per page (after warm-up)")
    args = parser.parse_args(argv)
    with scratch_database("ax_bench_web") as url:
        print(f"filling {args.rows} tasks …", flush=True)
        took = fill(url, args.rows)
        settings = from_env({}, database_url=url, broker_url="redis://127.0.0.1:6379/0",
                            broker_key_prefix="axbench:web:")
        client = Client(settings)
        beats = decorate(client)
        proc, base = serve(settings)
        try:
            def beat() -> None:
                for heartbeat, said in beats:
                    heartbeat.beat(said)

            figures = measure(base, pages(client), args.n, beat)
        finally:
            proc.terminate()
            proc.wait(30)
            client.close()
    report = {"rows": args.rows, "fill_s": round(took, 1), "machine": machine(),
              "date": datetime.now(UTC).isoformat(timespec="minutes"), "n": args.n,
              "load1": round(os.getloadavg()[0], 1), "pages": figures}
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
