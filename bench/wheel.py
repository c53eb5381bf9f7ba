"""The timer layer alone, as the scheduler's timing loop uses it: TriggerTimer against a
heapq timer with the same interface.

    .venv/bin/python -m bench.wheel [--n 10000 100000] [--shape burst mixed spread]
                                    [--rounds 7] [--spread-ms 5000] [--cancel 0.1]

A replay of :mod:`ax_kombu.scheduler.timing` on a simulated clock in 1 ms passes. N tasks
are preloaded at once (rows in due order, ``preload_batch`` a round, handed over in
``ABSORB_CHUNK`` chunks, one chunk absorbed per pass), the first due 1 s later. Shapes:
``burst``, all due at one instant (as ``python -m bench run --scenario burst``); ``spread``,
due times drawn evenly over ``--spread-ms``; ``mixed``, half of each. Each pass
absorbs a chunk, cancels the ids whose cancel time has come (``--cancel`` of them, at a
random time before they fire), advances to the pass's time plus ``claim_lead_ms`` and asks
for the next due time, as ``TimingLoop.run_once`` does. Three clocks: adds, pops (advance and
next due time), cancels. Rounds alternate which timer goes first; medians are printed.

The heap is a fair rival: a ``(due_ms, seq, key)`` heap with a dict of live entries, lazy
deletion for cancels and reschedules, a bulk add that is one inline loop, the same
earlier-time-wins rule and the same due order (ties in insertion order). Its cancels only
forget the live entry; popping the stale entries later is counted under "pop", while the
wheel takes a cancelled key out of its bucket at once, under "cancel".
"""

from __future__ import annotations

import argparse
import gc
import heapq
import random
import statistics
import time
from collections.abc import Iterable
from typing import Protocol

from ax_kombu.config import Settings
from ax_kombu.core.wheel import TriggerTimer
from ax_kombu.scheduler.timing import ABSORB_CHUNK, WHEEL_LEVELS

from .common import machine

START_MS = 1_000_000
#: the first task falls due this long after the preload
FIRST_DUE_MS = 1_000


class Timer(Protocol):
    def add_earlier_many(self, pairs: Iterable[tuple[int, int]]) -> None: ...
    def remove(self, key: int) -> bool: ...
    def advance(self, now_ms: int) -> list[int]: ...
    def next_due_ms(self) -> int | None: ...
    def __len__(self) -> int: ...


class HeapTimer:
    """A min-heap of (due_ms, seq, key) with lazy deletion: the baseline."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int]] = []
        self._live: dict[int, tuple[int, int]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def add_earlier_many(self, pairs: Iterable[tuple[int, int]]) -> None:
        live, heap, push, seq = self._live, self._heap, heapq.heappush, self._seq
        for key, due in pairs:
            old = live.get(key)
            if old is None or due < old[0]:
                seq += 1
                live[key] = (due, seq)
                push(heap, (due, seq, key))
        self._seq = seq

    def remove(self, key: int) -> bool:
        return self._live.pop(key, None) is not None

    def advance(self, now_ms: int) -> list[int]:
        heap, live, pop, fired = self._heap, self._live, heapq.heappop, []
        while heap and heap[0][0] <= now_ms:
            due, seq, key = pop(heap)
            if live.get(key) == (due, seq):
                del live[key]
                fired.append(key)
        return fired

    def next_due_ms(self) -> int | None:
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][2]) != heap[0][:2]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None


def wheel_timer() -> Timer:
    return TriggerTimer(START_MS, level_sizes=WHEEL_LEVELS)


def workload(n: int, shape: str, spread_ms: int, cancel: float, seed: int
             ) -> tuple[list[tuple[int, int]], dict[int, list[int]]]:
    """(task_id, due_ms) rows in due order, and the ids cancelled at each pass time."""
    rng = random.Random(seed)
    first, burst = START_MS + FIRST_DUE_MS, START_MS + FIRST_DUE_MS + spread_ms // 2
    rows = [(task_id, burst if (task_id % 2 == 1 if shape == "mixed" else shape == "burst")
             else first + rng.randrange(spread_ms)) for task_id in range(n)]
    rows.sort(key=lambda row: (row[1], row[0]))
    cancels: dict[int, list[int]] = {}
    absorbed = START_MS + n // ABSORB_CHUNK + 1
    for task_id, due in rng.sample(rows, int(n * cancel)):
        cancels.setdefault(rng.randrange(absorbed, due - 300), []).append(task_id)
    return rows, cancels


def replay(timer: Timer, rows: list[tuple[int, int]], cancels: dict[int, list[int]],
           lead_ms: int, preload_batch: int) -> tuple[float, float, float]:
    """Seconds spent adding, popping and cancelling over the whole replay."""
    chunks = [rows[i:i + ABSORB_CHUNK] for start in range(0, len(rows), preload_batch)
              for i in range(start, min(start + preload_batch, len(rows)), ABSORB_CHUNK)]
    chunks.reverse()
    clock = time.perf_counter
    added = popped = cancelled = 0.0
    fired, now = 0, START_MS
    while chunks or len(timer):
        began = clock()
        if chunks:
            timer.add_earlier_many(chunks.pop())
        took = clock()
        for task_id in cancels.get(now, ()):
            timer.remove(task_id)
        cut = clock()
        fired += len(timer.advance(now + lead_ms))
        timer.next_due_ms()
        ended = clock()
        added, cancelled, popped = added + took - began, cancelled + cut - took, popped + ended - cut
        now += 1
    assert fired == len(rows) - sum(map(len, cancels.values())), fired
    return added, popped, cancelled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--shape", nargs="+", choices=["burst", "mixed", "spread"],
                        default=["burst", "mixed", "spread"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--spread-ms", type=int, default=5_000)
    parser.add_argument("--cancel", type=float, default=0.1, help="share of ids cancelled")
    args = parser.parse_args()
    settings = Settings()
    print(f"{machine()}; claim_lead_ms {settings.claim_lead_ms}, preload_batch "
          f"{settings.preload_batch}, chunk {ABSORB_CHUNK}, wheel {WHEEL_LEVELS}")
    for shape, n in ((shape, n) for shape in args.shape for n in args.n):
        rows, cancels = workload(n, shape, args.spread_ms, args.cancel, seed=n)
        runs: dict[str, list[tuple[float, float, float]]] = {"heap": [], "wheel": []}
        for round_ in range(args.rounds):
            order = ("heap", "wheel") if round_ % 2 == 0 else ("wheel", "heap")
            for name in order:
                gc.collect()
                timer = HeapTimer() if name == "heap" else wheel_timer()
                runs[name].append(replay(timer, rows, cancels, settings.claim_lead_ms,
                                         settings.preload_batch))
        report(f"{shape} n={n:,}", runs)


def report(title: str, runs: dict[str, list[tuple[float, float, float]]]) -> None:
    medians = {name: [statistics.median(r[i] for r in rounds) for i in range(3)]
               + [statistics.median(sum(r) for r in rounds)]
               for name, rounds in runs.items()}
    print(f"{title} ({len(runs['heap'])} rounds), median ms: add / pop / cancel / total")
    for name, figures in medians.items():
        print(f"  {name:>5}: " + " / ".join(f"{s * 1000:8.1f}" for s in figures))
    pairs = list(zip(runs["heap"], runs["wheel"]))  # the rounds' own ratios, then their median
    ratios = [[h[i] / w[i] for h, w in pairs] for i in range(3)] + [[sum(h) / sum(w) for h, w in pairs]]
    print("  heap ÷ wheel, median of the rounds: "
          + " / ".join(f"{statistics.median(r):.2f}" for r in ratios)
          + f" (total {min(ratios[3]):.2f} to {max(ratios[3]):.2f})")


if __name__ == "__main__":
    main()
