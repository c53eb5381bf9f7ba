"""A Celery app's countdowns through ax, in a stock Celery worker with the AxBootstep (issue 22,
item 9): how late each call starts, and where the lateness comes from.

    python -m bench.celery_countdown [--n 2000] [--rate 500] [--countdown 5] [--threads 16]
                                     [--unfenced | --celery-eta] [--set claim_lead_ms=1000]
                                     [--logs DIR]

One ``ax-scheduler`` on a scratch PostgreSQL database, one stock
``celery -A bench.celery_ax_app worker -P threads -c THREADS`` (the bootstep; ``--unfenced``:
``bench.celery_app``, no bootstep) on Redis under a scratch key prefix, and a producer whose
app has ``ax.celery.install``: N ``apply_async((i, due), countdown=COUNTDOWN)`` calls paced
at RATE/s from :data:`PRODUCERS` threads. The body is the shared ledger body
(:mod:`bench.ledger`): it takes the wall clock first. ``--celery-eta``: the reference, the
same calls sent by Celery itself (its ETA path, no ax: lateness against the due time the
producer computed), to a worker without the bootstep.

Figures (ms, each against the task's ``trigger_time`` in ax, the due time ax stored from the
countdown on the database clock): ``start`` = the body's start (the ledger), ``claimed`` =
``dispatched_at`` (the scheduler's claim), ``fenced`` = ``started_at`` (the bootstep's
RUNNING move; a staged run's is its trigger time by construction, so ``start`` is what
counts). ``early`` counts bodies started before the trigger time; ``runs`` must equal N (each
once). One host: the worker's wall clock and PostgreSQL's are the same clock.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.config import from_env

from . import ledger
from .common import drop_redis_keys, pct, scratch_database
from .e2e import ROOT, _env, spawned

REDIS_URL = os.environ.get("AX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
#: threads calling ``apply_async`` (each an ax enqueue: ~3 round trips and a commit)
PRODUCERS = 8


@contextmanager
def celery_worker(args: argparse.Namespace, settings: Any, queue: str, prefix: str,
                  key: str, logs: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The stock Celery worker, warm-stopped on exit."""
    env = _env(settings, args.set)
    env.update({"AXBENCH_CELERY_BROKER": REDIS_URL, "AXBENCH_CELERY_PREFIX": prefix,
                "AXBENCH_CELERY_QUEUE": queue, ledger.URL_VAR: REDIS_URL,
                ledger.KEY_VAR: key})
    module = "bench.celery_app" if args.unfenced or args.celery_eta else "bench.celery_ax_app"
    cmd = [sys.executable, "-m", "celery", "-A", module, "worker", "-P", args.pool,
           "-c", str(args.threads), "-Q", queue, "-n", f"{queue}@localhost", "-l", "WARNING",
           "--without-gossip", "--without-mingle", "--without-heartbeat"]
    with open(logs / "celery-worker.log", "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def produce(task: Any, n: int, rate: float, countdown: float, offset: int = 0) -> float:
    """N calls paced at ``rate``/s from :data:`PRODUCERS` threads; returns the calls/s made."""
    counter = itertools.count()
    began = time.monotonic()

    def loop() -> None:
        while (k := next(counter)) < n:
            pause = began + k / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            task.apply_async((offset + k, time.time_ns() // 1_000_000 + round(countdown * 1000)),
                             countdown=countdown)

    threads = [threading.Thread(target=loop) for _ in range(PRODUCERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return n / (time.monotonic() - began)


def figures(client: Client, entries: list[ledger.Entry], celery_eta: bool) -> dict[str, Any]:
    """Start − due and its parts (see the module docstring)."""
    if celery_eta:  # Celery's own ETA path: due as the producer computed it, nothing in ax
        start = [e.lateness_ms for e in entries if e.i >= 0]
        return {"runs": len(start), "distinct": len({e.i for e in entries if e.i >= 0}),
                "early": sum(x < 0 for x in start), "start_p50": round(pct(start, 50), 2),
                "start_p99": round(pct(start, 99), 2), "start_max": round(max(start), 2)}
    with client.store.engine.connect() as conn:
        rows = {int(json.loads(r.payload)["args"][0]): r for r in conn.execute(text(
            "SELECT payload, trigger_time, dispatched_at, started_at, attempt, status "
            "FROM ax_task WHERE job IS NULL"))}
    start = [e.start_ms - rows[e.i].trigger_time for e in entries if e.i >= 0]
    late = sorted(((e.start_ms - rows[e.i].trigger_time, e.i) for e in entries if e.i >= 0),
                  reverse=True)[:20]
    measured = [r for i, r in rows.items() if i >= 0]  # not the warm-up's
    claimed = [r.dispatched_at - r.trigger_time for r in measured if r.dispatched_at]
    fenced = [r.started_at - r.trigger_time for r in measured if r.started_at]
    out: dict[str, Any] = {"tasks": len(rows), "runs": len(start),
                           "distinct": len({e.i for e in entries if e.i >= 0}),
                           "early": sum(x < 0 for x in start),
                           "attempts>1": sum(r.attempt > 1 for r in rows.values()),
                           "latest_i": sorted(i for _, i in late)}
    for name, values in (("start", start), ("claimed", claimed), ("fenced", fenced)):
        if values:
            out.update({f"{name}_p50": round(pct(values, 50), 2),
                        f"{name}_p99": round(pct(values, 99), 2),
                        f"{name}_max": round(max(values), 2),
                        f"{name}_min": round(min(values), 2)})
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ax_kombu.celery as axc

    from .celery_app import TASK_NAME, make_app  # Celery is optional: the bench extra

    tag = f"axbcc{os.getpid()}"
    queue, prefix, key = tag, f"{tag}:", f"{tag}:ledger"
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    ledger_client = redis.Redis.from_url(REDIS_URL)
    with scratch_database(tag) as url:
        settings = from_env({}, database_url=url, broker_url=REDIS_URL, broker_key_prefix=prefix)
        client = Client(settings)
        app = make_app(REDIS_URL, prefix, queue)
        if not args.celery_eta:
            axc.install(app, client=client, fenced=not args.unfenced)
        task = app.tasks[TASK_NAME]
        try:
            with spawned([("scheduler", f"{tag}-scheduler", ["-l", "WARNING"])],
                         _env(settings, args.set), logs), \
                    celery_worker(args, settings, queue, prefix, key, logs) as worker:
                nodes = 1 if args.unfenced or args.celery_eta else 2
                wait_until(lambda: _live(client) >= nodes, 60, "the scheduler and worker")
                produce(task, 50, 100, 0.2, offset=-1_000_000)  # warm-up
                wait_until(lambda: ledger_client.llen(key) >= 50, 60, "the warm-up")
                ledger_client.delete(key)
                rate = produce(task, args.n, args.rate, args.countdown)
                wait_until(lambda: ledger_client.llen(key) >= args.n or worker.poll() is not None,
                           args.countdown + args.n / args.rate + 60, "every run")
                time.sleep(1.0)  # a duplicate run would land now
                result = figures(client, ledger.read(ledger_client, key), args.celery_eta)
                result["produced_per_s"] = round(rate, 1)
        finally:
            axc.uninstall(app)
            client.close()
            app.close()
            drop_redis_keys(REDIS_URL, prefix)
            ledger_client.close()
    return result


def _live(client: Client) -> int:
    with client.store.engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM ax_node WHERE stopped_at IS NULL")).scalar() or 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.celery_countdown",
                                     description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--countdown", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--pool", default="threads")
    parser.add_argument("--unfenced", action="store_true",
                        help="a worker without the bootstep (ax hands each task off at publish)")
    parser.add_argument("--celery-eta", action="store_true",
                        help="the reference: Celery's own ETA path (no ax), the same worker "
                             "without the bootstep and the same producer")
    parser.add_argument("--set", action="append", default=[],
                        help="SETTING=VALUE for the ax daemons and the bootstep")
    parser.add_argument("--logs", default="/tmp/axbench-celery-countdown")
    result = run(parser.parse_args(argv))
    print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                      "load_1m": os.getloadavg()[0], **result}))


if __name__ == "__main__":
    main()
