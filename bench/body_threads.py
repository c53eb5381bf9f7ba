"""What one process can start of the shared body, by thread count (issue 21).

    python -m bench.body_threads [--n 5000] [--threads 1,2,4,8,16] [--processes 1]
                                 [--redis-url redis://127.0.0.1:6379/0]

N bodies (:func:`bench.ledger.record`, one ``RPUSH``), all due at one instant, run by T
threads taking them from one deque, no scheduler, broker or database involved; and the same
through ax's own :class:`~ax_kombu.worker.pools.Pool` (each job staged with its start time,
as the worker stages a burst). With ``--processes P`` that many such processes run at once
(the figure is then the slowest one's drain). Prints the drain time and the wall time per
body: the floor under any system that runs this body in one interpreter with T threads, and
how much of it is the GIL's hand-offs as T grows.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import threading
import time
import uuid

import redis

from ax_kombu.worker.pools import Outcome, Pool

from . import ledger

#: the body's due instant, this long after the jobs are handed over
LEAD_S = 1.0


def _setup(url: str) -> str:
    key = f"axbench:body:{uuid.uuid4().hex}"
    ledger.connect(url, key)
    return key


def _plain(n: int, threads: int) -> float:
    """Drain seconds of ``n`` bodies run by ``threads`` threads from one deque."""
    todo = collections.deque(range(n))
    start = time.monotonic() + LEAD_S

    def serve() -> None:
        time.sleep(max(0.0, start - time.monotonic()))
        while True:
            try:
                i = todo.popleft()
            except IndexError:
                return
            ledger.record(i, 0)

    workers = [threading.Thread(target=serve) for _ in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    return time.monotonic() - start


def _pool(n: int, threads: int) -> float:
    """Drain seconds of ``n`` bodies staged in an ax Pool of ``threads`` slots."""
    pool = Pool("default", threads)
    pool.stage_max = n
    left = [n]
    lock, done = threading.Lock(), threading.Event()

    def finished(_: Outcome) -> None:
        with lock:
            left[0] -= 1
            if not left[0]:
                done.set()

    start = time.monotonic() + LEAD_S
    for i in range(n):
        pool.try_submit(lambda i=i: ledger.record(i, 0), finished, timeout_s=60.0,
                        start_at=start, reserved=True)
    done.wait(120)
    drained = time.monotonic() - start
    pool.close()
    return drained


def _one(args: tuple[str, str, int, int]) -> float:
    url, kind, n, threads = args
    key = _setup(url)
    try:
        return (_plain if kind == "plain" else _pool)(n, threads)
    finally:
        redis.Redis.from_url(url).delete(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=5000, help="bodies per process")
    parser.add_argument("--threads", default="1,2,4,8,16")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    print("| runner | threads | processes | drain s (slowest) | µs per body per process |")
    print("|---|---|---|---|---|")
    with multiprocessing.get_context("spawn").Pool(args.processes) as procs:
        for threads in (int(t) for t in args.threads.split(",")):
            for kind in ("plain", "pool"):
                drains = procs.map(_one, [(args.redis_url, kind, args.n, threads)]
                                   * args.processes)
                slowest = max(drains)
                print(f"| {kind} | {threads} | {args.processes} | {slowest:.3f} | "
                      f"{slowest / args.n * 1e6:.0f} |")


if __name__ == "__main__":
    main()
