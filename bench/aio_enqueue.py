"""Async enqueue throughput (``ax_kombu.aio``) against the sync API, on PostgreSQL.

Four producers of the same N tasks, alternating in rounds on one scratch database:

* ``async single``: N ``await client.enqueue`` calls, ``--concurrency`` at a time on one
  event loop (a web server's handlers, each enqueuing one task);
* ``sync single, 1 thread`` and ``sync single, K threads``: N ``Client.enqueue`` calls from
  one thread, then from ``--concurrency`` threads sharing one client;
* ``async enqueue_many`` and ``sync enqueue_many``: N tasks in batches of ``--batch``.

Each row: tasks/s (the median over the rounds) and the process CPU seconds per 1,000 tasks.

    .venv/bin/python -m bench aio-enqueue [--n 10000] [--concurrency 50] [--batch 1000]
                                          [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from ax_kombu.aio import AsyncClient
from ax_kombu.api import Client
from ax_kombu.config import Settings, from_env

from .common import machine, median, scratch_database


def _timed(run: Callable[[], object], n: int) -> tuple[float, float]:
    """(tasks/s, process CPU s per 1,000 tasks) of ``run()``, which enqueues ``n`` tasks."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return n / wall, cpu / n * 1000


async def _async_single(client: AsyncClient, n: int, concurrency: int, tag: str) -> None:
    for start in range(0, n, concurrency):
        await asyncio.gather(*(client.enqueue("bench.aio", {"i": i, "tag": tag}, delay=3600)
                               for i in range(start, min(start + concurrency, n))))


async def _async_many(client: AsyncClient, n: int, batch: int, tag: str) -> None:
    for start in range(0, n, batch):
        await client.enqueue_many([{"task_type": "bench.aio", "payload": {"i": i, "tag": tag},
                                    "delay": 3600} for i in range(start, min(start + batch, n))])


def _sync_single(client: Client, n: int, threads: int, tag: str) -> None:
    def one(i: int) -> None:
        client.enqueue("bench.sync", {"i": i, "tag": tag}, delay=3600)

    if threads == 1:
        for i in range(n):
            one(i)
        return
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(n)))


def _sync_many(client: Client, n: int, batch: int, tag: str) -> None:
    for start in range(0, n, batch):
        client.enqueue_many([{"task_type": "bench.sync", "payload": {"i": i, "tag": tag},
                              "delay": 3600} for i in range(start, min(start + batch, n))])


def one_round(settings: Settings, args: argparse.Namespace, tag: str
              ) -> dict[str, tuple[float, float]]:
    """Every producer once, in turn, each on tasks of its own (``tag``)."""
    n, k, batch = args.n, args.concurrency, args.batch
    out: dict[str, tuple[float, float]] = {}

    async def run_async() -> None:
        async with AsyncClient(settings) as client:
            await client.enqueue("bench.warm", {"tag": tag})  # clock, ids, connections

            async def timed(name: str, work: Callable[[], Awaitable[None]]) -> None:
                wall, cpu = time.perf_counter(), time.process_time()
                await work()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                out[name] = (n / wall, cpu / n * 1000)

            await timed(f"async single, {k} concurrent",
                        lambda: _async_single(client, n, k, f"{tag}-as"))
            await timed(f"async enqueue_many ({batch})",
                        lambda: _async_many(client, n, batch, f"{tag}-am"))

    asyncio.run(run_async())
    sync = Client(settings)
    try:
        sync.enqueue("bench.warm", {"tag": f"{tag}-s"})
        out["sync single, 1 thread"] = _timed(lambda: _sync_single(sync, n, 1, f"{tag}-s1"), n)
        out[f"sync single, {k} threads"] = _timed(
            lambda: _sync_single(sync, n, k, f"{tag}-sk"), n)
        out[f"sync enqueue_many ({batch})"] = _timed(
            lambda: _sync_many(sync, n, batch, f"{tag}-sm"), n)
    finally:
        sync.close()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench aio-enqueue",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10_000, help="tasks per producer and round")
    parser.add_argument("--concurrency", type=int, default=50,
                        help="concurrent async calls, and sync threads")
    parser.add_argument("--batch", type=int, default=1000, help="items per enqueue_many")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with scratch_database("ax_bench_aio") as url:
        settings = from_env({}, database_url=url)
        rounds = [one_round(settings, args, f"r{r}") for r in range(args.rounds)]
    print(f"# ax_kombu.aio enqueue vs sync, PostgreSQL, {args.n} tasks per producer, "
          f"median of {args.rounds} rounds ({machine()})")
    print("| producer | tasks/s | CPU s per 1,000 |\n|---|---:|---:|")
    for name in rounds[0]:
        rate = median([r[name][0] for r in rounds])
        cpu = median([r[name][1] for r in rounds])
        print(f"| {name} | {rate:,.0f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
