"""The scheduler alone: claim + publish, with a plain Kombu consumer draining the queues.

Scenarios (PostgreSQL + Redis by default):

* ``burst``  — N tasks (default 100,000) due at the same instant: time from the
  trigger instant until the last one is published; p50/p99 of publish − trigger.
* ``steady`` — a producer process enqueues RATE tasks/s (default 2,000) with delays
  spread over 0.05–30 s for DURATION s (default 60): p50/p99/max of publish − trigger,
  and the scheduler's RSS.
* ``backlog`` — ``steady`` with 1,000,000 far-future tasks already in the table.

"Publish" is when the broker accepted the batch (Kombu's pipelined batch on Redis
returned; confirms received on RabbitMQ), reported by the scheduler's own
dispatcher, on the database clock.

    .venv/bin/python -m bench.scheduler burst [--n 100000]
    .venv/bin/python -m bench.scheduler steady [--rate 2000 --duration 60]
    .venv/bin/python -m bench.scheduler backlog [--backlog 1000000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from typing import Any

from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.broker.messages import ClaimedTask
from ax_kombu.config import Settings, from_env
from ax_kombu.scheduler.node import Scheduler

from .common import machine, pct, scratch_database


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Recorder:
    """Publish − trigger of each task's first publish (attempt 1)."""

    def __init__(self) -> None:
        self.lateness: list[int] = []
        self.repeats = 0
        self.last_ms = 0
        self.lock = threading.Lock()

    def __call__(self, messages: list[ClaimedTask], at_ms: int) -> None:
        with self.lock:
            self.lateness.extend(at_ms - m.trigger_time for m in messages if m.attempt == 1)
            self.repeats += sum(m.attempt != 1 for m in messages)
            self.last_ms = max(self.last_ms, at_ms)


def env_for(settings: Settings) -> dict[str, str]:
    return {**os.environ, "AX_DATABASE_URL": settings.database_url,
            "AX_BROKER_URL": settings.broker_url, "AX_BROKER_KEY_PREFIX": settings.broker_key_prefix}


def drainer(settings: Settings, seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "bench.drain", str(seconds)],
                            env=env_for(settings), stdout=subprocess.DEVNULL)


def run_scheduler(settings: Settings, recorder: Recorder) -> tuple[Scheduler, threading.Thread]:
    scheduler = Scheduler(settings, "bench-scheduler", on_published=recorder)
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    return scheduler, thread


def burst(settings: Settings, n: int, lead_s: float, baseline: bool = False) -> dict[str, Any]:
    client = Client(settings)
    trigger = client.store.now_ms() + int(lead_s * 1000)
    for base in range(0, n, 20_000):
        client.enqueue_many([{"task_type": "bench.burst", "payload": {"i": i},
                              "run_at": _dt(trigger)} for i in range(base, min(n, base + 20_000))])
    recorder = Recorder()
    drain = drainer(settings, lead_s + 120)
    deadline = time.monotonic() + lead_s + 120
    if baseline:
        poll_baseline(settings, recorder, n, deadline)
    else:
        scheduler, thread = run_scheduler(settings, recorder)
        while len(recorder.lateness) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        scheduler.request_stop()
        thread.join(60)
    drain.terminate()
    client.close()
    late = recorder.lateness
    return {"tasks": n, "published": len(late), "last_after_trigger_ms": recorder.last_ms - trigger,
            "rate_per_s": round(len(late) / max(1e-3, (recorder.last_ms - trigger) / 1000)),
            "first_ms": min(late),
            "p50_ms": pct(late, 50), "p99_ms": pct(late, 99), "max_ms": max(late),
            "rss_mb": round(rss_mb())}


def poll_baseline(settings: Settings, recorder: Recorder, n: int, deadline: float) -> None:
    """What users build today: poll the table every 200 ms, ``SELECT … FOR UPDATE SKIP
    LOCKED LIMIT 1000``, mark the rows, publish each with ``Producer.publish``."""
    from kombu import Producer

    from ax_kombu.broker.connection import connection, declare_queues

    client = Client(settings)
    claim_sql = text("""
        UPDATE ax_task SET status = 'DISPATCHING', attempt = attempt + 1
         WHERE task_id IN (SELECT task_id FROM ax_task WHERE status IN ('DELAYED', 'READY')
                              AND trigger_time <= :now ORDER BY trigger_time LIMIT 1000
                              FOR UPDATE SKIP LOCKED)
        RETURNING task_id, trigger_time, priority, payload""")
    with connection(settings) as conn:
        declare_queues(conn, settings)
        producer = Producer(conn.channel(), serializer="json")
        while len(recorder.lateness) < n and time.monotonic() < deadline:
            with client.store.engine.begin() as db:
                rows = list(db.execute(claim_sql, {"now": client.store.now_ms()}))
            for row in rows:
                producer.publish({"task_id": row.task_id, "payload": row.payload},
                                 routing_key=settings.queue_for(row.priority), exchange="")
            if rows:
                done = client.store.now_ms()
                with recorder.lock:
                    recorder.lateness.extend(done - r.trigger_time for r in rows)
                    recorder.last_ms = done
            else:
                time.sleep(0.2)
    client.close()


def steady(settings: Settings, rate: int, duration: float) -> dict[str, Any]:
    recorder = Recorder()
    drain = drainer(settings, duration + 45)
    scheduler, thread = run_scheduler(settings, recorder)
    time.sleep(1.0)
    producer = subprocess.Popen([sys.executable, "-m", "bench.produce", str(rate), str(duration)],
                                env=env_for(settings), stdout=subprocess.PIPE, text=True)
    out, _ = producer.communicate(timeout=duration + 120)
    produced = int(out.split()[0])
    deadline = time.monotonic() + 40
    while len(recorder.lateness) < produced and time.monotonic() < deadline:
        time.sleep(0.1)
    rss = rss_mb()
    scheduler.request_stop()
    thread.join(60)
    drain.terminate()
    late = recorder.lateness
    return {"produced": produced, "published": len(late), "republished": recorder.repeats,
            "p50_ms": pct(late, 50),
            "p99_ms": pct(late, 99), "max_ms": max(late), "rss_mb": round(rss)}


def add_backlog(url: str, rows: int) -> None:
    """``rows`` DELAYED tasks due 1–2 days ahead, written by the database itself."""
    from ax_kombu.store.engine import make_engine

    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("""
            INSERT INTO ax_task (task_id, task_type, trigger_time, status, priority, retry_count,
                max_retry, timeout_ms, processor_name, payload, fingerprint, trace_id, attempt,
                created_at)
            SELECT g, 'bench.future',
                   (extract(epoch from now()) * 1000)::bigint + 86400000 + g % 86400000,
                   'DELAYED', 'default', 0, 3, 60000, 'bench.future', '{}', md5(g::text),
                   md5(g::text), 0, 0
              FROM generate_series(1, :n) AS g"""), {"n": rows})
        conn.execute(text("ANALYZE ax_task"))
    engine.dispose()


def _dt(ms: int) -> Any:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ms / 1000, UTC)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=["burst", "steady", "backlog"])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--lead", type=float, default=15.0, help="burst: seconds until due")
    parser.add_argument("--rate", type=int, default=2000)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--backlog", type=int, default=1_000_000)
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--claim-batch", type=int, default=1000)
    parser.add_argument("--baseline", action="store_true",
                        help="burst: run the table-polling baseline instead of ax")
    args = parser.parse_args()
    with scratch_database(f"ax_bench_{args.scenario}") as url:
        # no worker moves tasks to RUNNING here: a long ack timeout keeps the scheduler
        # from re-dispatching what it published (that path is measured by bench.e2e)
        settings = from_env({}, database_url=url, broker_url=args.broker, ack_timeout_ms=3_600_000,
                            broker_key_prefix=f"axbench{os.getpid()}:",
                            claim_batch=args.claim_batch)
        if args.scenario == "burst":
            result = burst(settings, args.n, args.lead, args.baseline)
        else:
            if args.scenario == "backlog":
                add_backlog(url, args.backlog)
            result = steady(settings, args.rate, args.duration)
    label = args.scenario + (" (baseline: table polling)" if args.baseline else " (ax)")
    print(f"{label} on {machine()}: " + ", ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
