"""The timer layer alone: TriggerTimer vs a heapq baseline, N keys due over 60 s.

    .venv/bin/python -m bench.wheel [--n 1000000]
"""

from __future__ import annotations

import argparse
import heapq
import random
import time

from ax_kombu.core.wheel import TriggerTimer
from ax_kombu.scheduler.timing import WHEEL_LEVELS

from .common import machine


def run_wheel(dues: list[int]) -> tuple[float, float]:
    timer: TriggerTimer[int] = TriggerTimer(0, level_sizes=WHEEL_LEVELS)
    start = time.perf_counter()
    for key, due in enumerate(dues):
        timer.add(key, due)
    added = time.perf_counter()
    fired = sum(len(timer.advance(now)) for now in range(1, 60_001))
    assert fired == len(dues)
    return len(dues) / (added - start), fired / (time.perf_counter() - added)


def run_heap(dues: list[int]) -> tuple[float, float]:
    heap: list[tuple[int, int]] = []
    start = time.perf_counter()
    for key, due in enumerate(dues):
        heapq.heappush(heap, (due, key))
    added = time.perf_counter()
    fired = 0
    for now in range(1, 60_001):
        while heap and heap[0][0] <= now:
            heapq.heappop(heap)
            fired += 1
    return len(dues) / (added - start), fired / (time.perf_counter() - added)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=1_000_000)
    args = parser.parse_args()
    rng = random.Random(3)
    dues = [rng.randrange(1, 60_001) for _ in range(args.n)]
    for name, run in (("heapq baseline", run_heap), ("TriggerTimer", run_wheel)):
        adds, fires = run(dues)
        print(f"{name:>15} on {machine()}: {args.n:,} keys over 60 s: "
              f"add {adds / 1e3:,.0f} k/s, fire {fires / 1e3:,.0f} k/s")


if __name__ == "__main__":
    main()
