"""The overview's two charts, computed on the server and drawn as inline SVG.

Pure code (no I/O; the times are arguments): :func:`lateness` turns the
``(trigger_time, started_at)`` pairs of :func:`ax_kombu.store.console.started_since` into
10-second buckets by start time — start − due p50 and p99, and tasks started per
second — and :func:`polyline` scales a series onto the chart's box.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ax_kombu.core.planning import percentile

#: the charts' span and bucket (ms)
WINDOW_MS = 3_600_000
BUCKET_MS = 10_000
#: the SVG box the series are drawn in (user units)
WIDTH, HEIGHT = 720, 140


@dataclass(frozen=True)
class Lateness:
    """One value per bucket, oldest first (None: nothing started in that bucket)."""

    p50_ms: list[int | None]
    p99_ms: list[int | None]
    started_per_s: list[float]
    #: how many starts the buckets hold
    starts: int


def lateness(pairs: Sequence[tuple[int, int]], now_ms: int) -> Lateness:
    """Bucket ``pairs`` (due, started) by start time over the :data:`WINDOW_MS` before
    ``now_ms``; a start outside the window is left out, a start before its due time
    counts as 0 ms late."""
    count = WINDOW_MS // BUCKET_MS
    first = now_ms - WINDOW_MS
    buckets: list[list[int]] = [[] for _ in range(count)]
    for due, started in pairs:
        index = (started - first) // BUCKET_MS
        if 0 <= index < count:
            buckets[index].append(max(0, started - due))
    for late in buckets:
        late.sort()
    return Lateness(p50_ms=[percentile(b, 50) if b else None for b in buckets],
                    p99_ms=[percentile(b, 99) if b else None for b in buckets],
                    started_per_s=[len(b) * 1000 / BUCKET_MS for b in buckets],
                    starts=sum(len(b) for b in buckets))


def top(values: Sequence[float | None]) -> float:
    """The value the chart's top edge stands for: the largest one (1 when all are 0)."""
    return max((v for v in values if v is not None), default=0) or 1


def polyline(values: Sequence[float | None], ceiling: float) -> list[str]:
    """``values`` as SVG polyline point lists (``"x,y x,y …"``), one per unbroken run:
    a None (an empty bucket) breaks the line; a run of one value is drawn as a short dash
    so that it shows."""
    step = WIDTH / max(1, len(values) - 1)
    runs: list[list[str]] = [[]]
    for i, value in enumerate(values):
        if value is None:
            if runs[-1]:
                runs.append([])
            continue
        y = HEIGHT - min(value, ceiling) / ceiling * HEIGHT
        runs[-1].append(f"{i * step:.1f},{y:.1f}")
    return [" ".join(run if len(run) > 1 else [run[0], _nudged(run[0], step)])
            for run in runs if run]


def _nudged(point: str, step: float) -> str:
    """``point`` moved one step left, or right at the left edge."""
    x, y = (float(v) for v in point.split(","))
    return f"{x - step if x >= step else x + step:.1f},{y:.1f}"
