"""ax, Celery ETA and 200 ms table polling side by side, the same body, the same run (issue 15),
and on demand the PostgreSQL peers: a tight poller, PgQueuer and Procrastinate.

    python -m bench run --scenario burst|spread|steady|backlog [--n N] [--broker redis|rabbitmq]
                        [--systems ax,celery,polling] [--repeat R] [--out DIR]

Systems (``--systems``, default ``ax,celery,polling``; see :mod:`bench.systems`): ``ax``,
``celery`` (Celery ETA), ``celery-ax`` (Celery's ETA calls through ax), ``polling`` (a
table polled every 200 ms), ``tight-poller`` (16 threads each claiming 50 due rows in a
loop), ``pgqueuer`` (PgQueuer 1.6, ``execute_after``) and ``procrastinate``
(Procrastinate 3.10, ``schedule_at``); the last two need the ``bench`` extra.

Scenarios (N defaults to 10,000):

* ``burst``  — N tasks all due at one instant, LEAD s after they are handed over.
* ``spread`` — N tasks due RATE/s apart (default 500/s: 10,000 over 20 s), the first
  LEAD s after they are handed over.
* ``steady`` — the due times of ``spread``, but each task is handed over live, DELAY s
  (default 1) before it is due, in 50 ms ticks: the system takes new work while it runs.
* ``backlog`` — N tasks all due at the instant their hand-over begins, so each arrives
  already due (what a system meets after an outage, or when a producer enqueues work to run
  now): the drain rate and how late the last one starts, with no head start for anyone.

Every system is started fresh for each run, on loopback, with its own scratch state (see
:mod:`bench.systems`), in the order given, and the whole order again for each repeat, so
ratios come from the same run. A run first passes 100 warm-up tasks through the system,
then hands it all N tasks ahead of their due time, and ends once every task has started or
TIMEOUT s after the last due time. The first due time is LEAD s after the hand-over
begins, or later when the warm-up's hand-over took so long per task that N would not be in
by then (``lead_s`` says which; ``enqueue_s`` how long the hand-over took; one that still
ended after the first due time is flagged ``late_handover``). The lead changes nothing
else: every task is in its system before it is due. In ``steady``,
``late_handover_tasks`` counts the tasks handed over after their due time (the producer
fell behind).

Every figure comes from the ledger the shared body writes (:mod:`bench.ledger`): the wall
clock when the body started, against the due time the producer set. ``first_ms`` is
start − due of the task that started first; ``early`` counts tasks started before their
due time by the wall clock (ax holds a staged task until its trigger time on its estimate
of the database clock, which can be off by a fraction of a round trip); ``tasks_per_s`` is
the tasks started over the time from the first due time to the last start;
``worker_rss_peak_mb`` is the peak RSS (``VmHWM``) of the process running the body (ax:
the ``ax-worker``; the ``ax-scheduler``'s is ``scheduler_rss_peak_mb``). Prints a table
and the ratios, writes JSON to ``--out`` and one PNG per scenario to ``--img`` (matplotlib).
"""

from __future__ import annotations

import argparse
import bisect
import os
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from . import ledger
from .common import cpu_s, drop_redis_keys, pct, proc_mb, rabbit_vhost, wait_quiet
from .e2e import ROOT
from .report import report
from .systems import SYSTEMS, Config, Running

REDIS_URL = os.environ.get("AX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
#: what is printed after each run
PROGRESS = ["ran", "p50_ms", "p99_ms", "max_ms", "first_ms", "tasks_per_s", "lead_s", "enqueue_s",
            "late_handover_tasks", "load_1m"]
#: warm-up tasks per run: they also time the hand-over, to stretch the lead if it is slow
WARM_UP = 100
#: the lead is never stretched beyond this (a hand-over still late is flagged)
MAX_LEAD_S = 240.0
#: steady: how often the tasks coming due are handed over
TICK_S = 0.05


# -- one run ---------------------------------------------------------------------------------------

def due_times(scenario: str, n: int, first_ms: int, rate: float) -> list[int]:
    """Each task's due time (epoch ms): all at ``first_ms``, or ``rate``/s from it."""
    if scenario in ("burst", "backlog"):
        return [first_ms] * n
    return [first_ms + round(k * 1000 / rate) for k in range(n)]


def wait_ledger(client: redis.Redis, key: str, count: int, until: float,
                running: Running) -> int:
    """Poll the ledger's length until ``count`` (or time ``until``, or a process died)."""
    while True:
        got = int(client.llen(key))
        if got >= count or time.time() > until or not running.alive():
            return got
        time.sleep(0.25)


def warm_up(client: redis.Redis, key: str, running: Running) -> float:
    """Pass :data:`WARM_UP` tasks (``i`` < 0, due now) through the system, then empty the
    ledger; returns how long handing them over took per task (s)."""
    now = time.time_ns() // 1_000_000
    began = time.monotonic()
    running.submit([(-1 - k, now) for k in range(WARM_UP)])
    per_task = (time.monotonic() - began) / WARM_UP
    if wait_ledger(client, key, WARM_UP, time.time() + 90, running) < WARM_UP:
        raise SystemExit(f"the warm-up tasks did not run (see the logs); alive={running.alive()}")
    client.delete(key)
    return per_task


def feed(running: Running, args: argparse.Namespace) -> tuple[list[int], int]:
    """``steady``: hand the tasks over live, every :data:`TICK_S`, each DELAY s before its
    due time (RATE/s for N/RATE s); returns the due times and how many tasks were handed
    over after their due time (the producer fell behind)."""
    delay_ms = args.delay * 1000
    dues = due_times("spread", args.n, time.time_ns() // 1_000_000 + round(delay_ms), args.rate)
    done = late = ticks = 0
    began = time.monotonic()
    while done < len(dues):
        upto = bisect.bisect_right(dues, time.time() * 1000 + delay_ms, lo=done)
        if upto > done:
            running.submit(list(zip(range(done, upto), dues[done:upto], strict=True)))
            now = time.time() * 1000
            late += sum(due < now for due in dues[done:upto])
            done = upto
        ticks += 1
        time.sleep(max(0.0, began + ticks * TICK_S - time.monotonic()))
    return dues, late


def lead_for(args: argparse.Namespace, per_task_s: float) -> float:
    """``--lead``, or longer when the warm-up says handing N tasks over takes longer
    (1.25 × the estimate + 3 s, at most :data:`MAX_LEAD_S`): every task must be in before
    its due time."""
    lead: float = max(args.lead, min(MAX_LEAD_S, 1.25 * per_task_s * args.n + 3.0))
    return round(lead, 1)


def measure(system: str, repeat: int, config: Config, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one system: start it, warm it, hand it the tasks, collect the ledger."""
    tag = f"{system}{repeat}"
    key = f"{config.prefix}ledger:{tag}"
    client = redis.Redis.from_url(config.redis_url)
    try:
        with SYSTEMS[system](config, key, tag) as running:
            per_task_s = warm_up(client, key, running)
            began = time.monotonic()
            if args.scenario == "steady":
                lead_s = args.delay
                dues, late = feed(running, args)
            else:  # backlog: due as the hand-over begins, no lead by design (never "late")
                backlog = args.scenario == "backlog"
                lead_s = 0.0 if backlog else lead_for(args, per_task_s)
                first = time.time_ns() // 1_000_000 + round(lead_s * 1000)
                dues = due_times(args.scenario, args.n, first, args.rate)
                running.submit(list(enumerate(dues)))
                late = args.n if not backlog and time.time() * 1000 > first else 0
            enqueue_s = time.monotonic() - began
            load = os.getloadavg()[0]
            wait_ledger(client, key, args.n, dues[-1] / 1000 + args.timeout, running)
            procs = {role: proc.pid for role, proc in running.procs.items()}
            usage: dict[str, float] = {f"{role}_rss_peak_mb": proc_mb(pid, "VmHWM")
                                       for role, pid in procs.items()}
            usage |= {f"{role}_cpu_s": round(cpu_s(pid), 1) for role, pid in procs.items()}
        entries = ledger.read(client, key)
    finally:
        client.close()
    return {"system": system, "repeat": repeat, "lead_s": lead_s,
            "enqueue_s": round(enqueue_s, 2), "late_handover": late > 0,
            "late_handover_tasks": late,
            "load_1m": round(load, 1), **summarise(entries, dues), **usage}


def summarise(entries: Sequence[ledger.Entry], dues: Sequence[int]) -> dict[str, Any]:
    """The figures of one run from its ledger (a task's first run counts; repeats are
    counted as ``duplicates``)."""
    first: dict[int, ledger.Entry] = {}
    for entry in entries:
        if entry.i >= 0:
            first.setdefault(entry.i, entry)
    runs = list(first.values())
    late = sorted(e.lateness_ms for e in runs)
    out: dict[str, Any] = {"n": len(dues), "ran": len(runs), "missing": len(dues) - len(runs),
                           "duplicates": sum(e.i >= 0 for e in entries) - len(runs)}
    if not runs:
        return out | {"lateness_ms": [], "timeline": {"start_s": 0.0, "counts": []}}
    earliest = min(runs, key=lambda e: e.start_ms)
    span_s = max(1e-3, (max(e.start_ms for e in runs) - dues[0]) / 1000)
    return out | {
        "p50_ms": round(pct(late, 50), 2), "p99_ms": round(pct(late, 99), 2),
        "max_ms": round(late[-1], 2), "min_ms": round(late[0], 2),
        "early": sum(v < 0 for v in late), "first_ms": round(earliest.lateness_ms, 2),
        "tasks_per_s": round(len(runs) / span_s), "lateness_ms": late,
        "timeline": timeline([e.start_ms for e in runs], dues[0])}


def timeline(starts: Sequence[float], origin_ms: int) -> dict[str, Any]:
    """Starts per 100 ms bucket, from the bucket of the earliest (or of ``origin_ms``)."""
    buckets = Counter(int((s - origin_ms) // 100) for s in starts)
    low = min(0, *buckets)
    counts = [buckets.get(k, 0) for k in range(low, max(buckets) + 1)]
    return {"start_s": low / 10, "counts": counts}


# -- the command ----------------------------------------------------------------------------------

@contextmanager
def broker(args: argparse.Namespace, prefix: str) -> Iterator[str]:
    """The broker URL for this invocation: Redis, or a scratch RabbitMQ vhost."""
    if args.broker == "redis":
        yield args.redis_url
    else:
        with rabbit_vhost(prefix.rstrip("_")) as url:
            yield url


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=["burst", "spread", "steady", "backlog"], required=True)
    parser.add_argument("--n", type=int, default=10_000, help="tasks (default 10,000)")
    parser.add_argument("--rate", type=float, default=500.0,
                        help="spread, steady: tasks due per s")
    parser.add_argument("--delay", type=float, default=1.0,
                        help="steady: s from a task's hand-over to its due time")
    parser.add_argument("--lead", type=float, default=None,
                        help="s from the hand-over to the first due time (default 5 + n/500)")
    parser.add_argument("--broker", choices=["redis", "rabbitmq"], default="redis")
    parser.add_argument("--systems", default="ax,celery,polling",
                        help="comma-separated, run in this order, of: ax, celery, celery-ax, "
                             "polling, tight-poller, pgqueuer, procrastinate")
    parser.add_argument("--repeat", type=int, default=1, help="run the whole order R times")
    parser.add_argument("--threads", type=int, default=16,
                        help="Celery -c, poller threads, PgQueuer and Procrastinate concurrency "
                             "(ax: its default pools, 16 for default)")
    parser.add_argument("--ax-concurrency", default="",
                        help="ax-worker -c, e.g. default=64 (default: ax's pools, 16 for default)")
    parser.add_argument("--ax-processes", default="",
                        help="ax-worker --processes (default: its own, auto)")
    parser.add_argument("--ax-set", action="append", default=[], metavar="SETTING=VALUE",
                        help="an ax setting for its daemons (AX_<SETTING>), e.g. claim_lead_ms=20")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="give up this many s after the last due time")
    parser.add_argument("--redis-url", default=REDIS_URL, help="the ledger's Redis (and broker)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="JSON goes here")
    parser.add_argument("--img", default=str(ROOT / "docs" / "img"),
                        help="the PNG goes here ('' for none)")
    parser.add_argument("--logs", default=f"/tmp/axbench-run-{os.getpid()}",
                        help="the processes' logs")
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown or not args.systems:
        parser.error(f"--systems: unknown {', '.join(sorted(unknown)) or '(none given)'}")
    if args.lead is None:
        args.lead = 5.0 + args.n / 500
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    started = datetime.now(UTC)
    prefix = f"axbench_r{os.getpid()}_"
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    results = []
    try:
        with broker(args, prefix) as url:
            config = Config(args.broker, url, args.redis_url, prefix, args.threads,
                            Path(args.logs), args.ax_concurrency, tuple(args.ax_set),
                            args.ax_processes)
            for repeat in range(args.repeat):
                for system in args.systems:
                    wait_quiet()
                    print(f"{system} #{repeat + 1}: {args.scenario}, n={args.n:,} …", flush=True)
                    results.append(measure(system, repeat, config, args))
                    res = results[-1]
                    print("  " + ", ".join(f"{k}={res.get(k)}" for k in PROGRESS), flush=True)
            report(results, config, args, started)
    finally:
        drop_redis_keys(args.redis_url, prefix)


if __name__ == "__main__":
    main()
