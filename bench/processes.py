"""CPU-bound tasks on ``ax-worker --processes 1`` and ``--processes 2`` (issue 15).

Each task runs ``bench.cpu``: a pure-Python loop calibrated here to about
``--task-ms`` (5 ms) of one core, holding the GIL throughout, so one worker
process runs at most ~1000/5 = 200 of them a second whatever its pool size,
and a second process is a second core.

Each run: ``--n`` due tasks are enqueued and claimed as a scheduler would
(no scheduler runs), the worker is started with ``--processes P``, and once
its P processes are registered every message is published to Redis.
tasks/s is ``n / (last finished_at - first started_at)``, from the database.
The runs alternate P = 1, 2, 1, 2 … (``--rounds`` each, on one scratch
database), and the medians are reported, with the CPU seconds of the worker
processes and of PostgreSQL (a lower bound: backends that ended are missed)
during each run, and the 1-minute load average before and after it.

    .venv/bin/python -m bench.processes [--n 2000] [--rounds 2] [-c 2] [--task-ms 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import text

import ax_kombu as ax
from ax_kombu.api import Client
from ax_kombu.broker.publisher import Publisher
from ax_kombu.config import Settings, from_env
from ax_kombu.scheduler.dispatcher import to_message
from ax_kombu.store import claims

from .common import cpu_s, drop_redis_keys, machine, median, scratch_database, wait_quiet
from .e2e import _command, _env, scalar

TASK_TYPE = "bench.cpu"
CLAIMER = "bench-claimer"


def spin(loops: int) -> int:
    """Pure Python work: ``loops`` multiply-adds."""
    acc = 0
    for i in range(loops):
        acc += i * i
    return acc


@ax.processor(TASK_TYPE)
def cpu_task(payload: Any, ctx: Any) -> None:
    """About ``--task-ms`` of one core (the payload's ``loops``, calibrated by the bench)."""
    spin(int(payload["loops"]))


def calibrate(task_ms: float) -> int:
    """How many :func:`spin` loops take ``task_ms`` here (the fastest of a few tries)."""
    probe = 200_000
    best = min(_timed(probe) for _ in range(5))
    return max(1, int(probe * task_ms / 1000.0 / best))


def _timed(loops: int) -> float:
    started = time.perf_counter()
    spin(loops)
    return time.perf_counter() - started


def prepare(client: Client, n: int, loops: int) -> list[Any]:
    """Enqueue ``n`` due tasks and claim them as a scheduler would; returns the claimed rows."""
    with client.store.engine.begin() as conn:
        conn.execute(text("TRUNCATE ax_task, ax_attempt, ax_due"))
    run_at = datetime.fromtimestamp((client.store.now_ms() - 1000) / 1000, UTC)
    client.enqueue_many([{"task_type": TASK_TYPE, "payload": {"loops": loops, "i": i},
                          "run_at": run_at} for i in range(n)])
    with client.store.engine.begin() as conn:
        ids = [r[0] for r in conn.execute(text("SELECT task_id FROM ax_task ORDER BY task_id"))]
    rows: list[Any] = []
    for base in range(0, n, 1000):  # the scheduler's batch size
        with client.store.engine.begin() as conn:
            rows += claims.claim(conn, ids[base:base + 1000], CLAIMER, client.store.now_ms())
    return rows


def postgres_cpu() -> dict[int, float]:
    """CPU seconds so far of each local PostgreSQL process, by pid."""
    found: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as comm:
                if comm.read().strip() == "postgres":
                    found[int(entry)] = cpu_s(int(entry))
        except OSError:
            continue
    return found


def postgres_cpu_since(before: dict[int, float]) -> float:
    """PostgreSQL CPU seconds since ``before`` over the processes alive now (backends that
    ended meanwhile are missing, so this is a lower bound; never negative)."""
    return sum(max(0.0, now - before.get(pid, 0.0)) for pid, now in postgres_cpu().items())


def live_pids(client: Client, name: str) -> list[int]:
    """The pids of the live worker processes named ``name`` or ``name.i``."""
    with client.store.engine.connect() as conn:
        return [r[0] for r in conn.execute(text(
            "SELECT pid FROM ax_node WHERE stopped_at IS NULL "
            "AND (node_id = :n OR node_id LIKE :children)"), {"n": name, "children": name + ".%"})]


def wait_for(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.2)


def run_once(settings: Settings, client: Client, args: argparse.Namespace, loops: int,
             processes: int, label: str) -> dict[str, Any]:
    """One run with ``--processes processes``; its figures."""
    wait_quiet()
    rows = prepare(client, args.n, loops)
    name = f"bench-proc-{label}"
    load = os.getloadavg()[0]
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.log", "wb") as out:
        proc = subprocess.Popen(
            [*_command("worker"), "-n", name, "-Q", "high,default,slow", "-A", "bench.processes",
             "-l", "WARNING", "-c", args.concurrency, "--processes", str(processes)],
            env=_env(settings), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(live_pids(client, name)) == processes, 60, "worker processes up")
        pids = [proc.pid, *live_pids(client, name)] if processes > 1 else [proc.pid]
        cpu_before, pg_before = sum(cpu_s(p) for p in pids), postgres_cpu()
        publisher = Publisher(settings)
        try:
            now = client.store.now_ms()
            failed = publisher.publish([to_message(r, CLAIMER, now) for r in rows])
        finally:
            publisher.close()
        if failed:
            raise SystemExit(f"{len(failed)} messages could not be published")
        wait_for(lambda: scalar(client, "SELECT COUNT(*) FROM ax_task WHERE status IN "
                                        "('SUCCESS', 'FAILED')") >= args.n,
                 args.timeout, f"{args.n} tasks finished")
        worker_cpu = sum(cpu_s(p) for p in pids) - cpu_before
        pg_cpu = postgres_cpu_since(pg_before)
        load_after = os.getloadavg()[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    first, last = (scalar(client, f"SELECT {f} FROM ax_task") for f in
                   ("MIN(started_at)", "MAX(finished_at)"))
    success = scalar(client, "SELECT COUNT(*) FROM ax_task WHERE status = 'SUCCESS'")
    span_s = max(1e-3, (last - first) / 1000)
    return {"processes": processes, "tasks": args.n, "success": int(success),
            "span_s": round(span_s, 2), "tasks_per_s": round(args.n / span_s, 1),
            "worker_cpu_s": round(worker_cpu, 1), "postgres_cpu_s": round(pg_cpu, 1),
            "load_1m_before": round(load, 2), "load_1m_after": round(load_after, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting")
    parser.add_argument("--task-ms", type=float, default=5.0)
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--concurrency", "-c", default="2", help="-c of each worker process")
    parser.add_argument("--timeout", type=float, default=180.0, help="per run")
    parser.add_argument("--logs", default=f"/tmp/ax-bench-processes-{os.getpid()}")
    args = parser.parse_args()
    loops = calibrate(args.task_ms)
    runs: list[dict[str, Any]] = []
    with scratch_database("ax_bench_processes") as url:
        settings = from_env({}, database_url=url, broker_url=args.broker,
                            broker_key_prefix=f"axbenchproc{os.getpid()}:")
        client = Client(settings)
        try:
            for round_ in range(args.rounds):
                for processes in (1, 2):
                    runs.append(run_once(settings, client, args, loops, processes,
                                         f"{processes}-{round_}"))
                    print(json.dumps(runs[-1]), flush=True)
        finally:
            client.close()
            drop_redis_keys(settings.broker_url, settings.broker_key_prefix)
    rate = {p: median([r["tasks_per_s"] for r in runs if r["processes"] == p]) for p in (1, 2)}
    print(f"CPU-bound tasks ({args.task_ms:g} ms of pure Python, {loops} loops) on {machine()}, "
          f"-c {args.concurrency}, n={args.n}, {args.rounds} rounds alternating: median tasks/s "
          f"--processes 1: {rate[1]:.1f}, --processes 2: {rate[2]:.1f}, "
          f"ratio {rate[2] / rate[1]:.2f}x")


if __name__ == "__main__":
    main()
