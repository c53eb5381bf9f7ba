"""Enqueue rates on PostgreSQL: single ``enqueue`` calls/s and ``enqueue_many`` rows/s.

Baseline in the same run: a bare one-row INSERT per transaction through the
same engine (what any producer pays for a durable write), so the cost of
ax's validation, id lease and duplicate check shows as a ratio.

    .venv/bin/python -m bench.enqueue [--single 3000] [--bulk 100000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.config import from_env

from .common import machine, median, scratch_database


def bare_inserts(client: Client, n: int) -> float:
    with client.store.engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS bench_bare (id BIGINT PRIMARY KEY, "
                          "payload TEXT)"))
    start = time.perf_counter()
    for i in range(n):
        with client.store.engine.begin() as conn:
            conn.execute(text("INSERT INTO bench_bare VALUES (:i, :p)"),
                         {"i": i + int(start * 1e6), "p": '{"user": 1}'})
    return n / (time.perf_counter() - start)


def single(client: Client, n: int, tag: str) -> float:
    start = time.perf_counter()
    for i in range(n):
        client.enqueue("bench.single", {"i": i, "tag": tag}, delay=3600)
    return n / (time.perf_counter() - start)


def bulk(client: Client, n: int, tag: str, chunk: int = 10_000) -> float:
    start = time.perf_counter()
    for base in range(0, n, chunk):
        client.enqueue_many([{"task_type": "bench.bulk", "payload": {"i": i, "tag": tag},
                              "delay": 3600 + i % 600} for i in range(base, base + chunk)])
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--single", type=int, default=3000)
    parser.add_argument("--bulk", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with scratch_database("ax_bench_enqueue") as url:
        client = Client(from_env({}, database_url=url))
        rates: dict[str, list[float]] = {"bare": [], "single": [], "bulk": []}
        for r in range(args.rounds):
            rates["bare"].append(bare_inserts(client, args.single))
            rates["single"].append(single(client, args.single, f"r{r}"))
            rates["bulk"].append(bulk(client, args.bulk, f"r{r}"))
        client.close()
    print(f"machine: {machine()}; rounds: {args.rounds}")
    for name, values in rates.items():
        print(f"{name:>7}: median {median(values):,.0f}/s  (runs: "
              + ", ".join(f"{v:,.0f}" for v in values) + ")")
    print(f"single enqueue / bare insert: {median(rates['single']) / median(rates['bare']):.2f}")


if __name__ == "__main__":
    main()
