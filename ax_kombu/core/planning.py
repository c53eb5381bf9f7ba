"""Capacity planning: how many worker threads and nodes a peak load needs (``ax plan``).

The method of the first design article, which is Little's law applied to a thread pool:

* one thread that spends ``avg_ms`` on each task finishes ``1000 / avg_ms`` tasks a second
  (``per_thread_rate``);
* to keep up with ``peak_rate`` tasks a second, ``peak_rate × avg_ms / 1000`` threads must
  be busy at once — rounded **up**, since a fraction of a thread short is a backlog that
  grows for as long as the peak lasts (``threads``);
* one node runs ``threads_per_node`` threads (100 by default), so
  ``ceil(threads / threads_per_node)`` nodes (``nodes``);
* the article's rule for the queue in front of the pools: 200 waiting tasks per thread
  (``queue_length = threads × 200``), room for a burst above the peak.

The article's example: 2000 tasks/s at 200 ms each → 5 tasks/s per thread, 400 threads,
4 nodes of 100 threads, a queue of 80 000.

Assumptions, each an error in the plan when it does not hold: the run time is the
*average* and the arrival rate the *peak* one, steady (a burst above the peak is absorbed
by the queue, not by the threads); run times do not grow with load (a shared database or
API that slows down under the peak makes every thread slower); a node really runs
``threads_per_node`` tasks at once (CPU-bound tasks need about one thread per core
instead); and there is no headroom — add spare nodes for losing one and for deploys.

Everything here is pure: the inputs are arguments, nothing is read or written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ax_kombu.core.errors import ValidationError

#: waiting tasks per thread in the queue in front of the pools (the article's rule)
QUEUE_PER_THREAD = 200
DEFAULT_THREADS_PER_NODE = 100


@dataclass(frozen=True)
class Plan:
    """What a peak load needs; the inputs are kept for showing."""

    peak_rate: float
    avg_ms: float
    threads_per_node: int
    #: tasks a second one thread sustains
    per_thread_rate: float
    threads: int
    nodes: int
    queue_length: int


def plan(peak_rate: float, avg_ms: float,
         threads_per_node: int = DEFAULT_THREADS_PER_NODE) -> Plan:
    """The threads, nodes and queue length that ``peak_rate`` tasks a second of ``avg_ms``
    each need (the method is in the module's docstring).

    Args:
        peak_rate: tasks arriving a second at the peak.
        avg_ms: the average run time of one task, in milliseconds.
        threads_per_node: how many tasks one node runs at once.

    Returns:
        The :class:`Plan`.

    Raises:
        ValidationError: an argument is not a positive finite number (``threads_per_node``:
            not a positive integer).
    """
    validate(peak_rate, avg_ms, threads_per_node)
    busy = peak_rate * avg_ms / 1000.0
    # 400.00000000000006 threads is 400: float noise must not buy a whole thread (or node)
    threads = max(1, math.ceil(round(busy, 9)))
    return Plan(peak_rate=peak_rate, avg_ms=avg_ms, threads_per_node=threads_per_node,
                per_thread_rate=1000.0 / avg_ms, threads=threads,
                nodes=-(-threads // threads_per_node),
                queue_length=threads * QUEUE_PER_THREAD)


def validate(peak_rate: float, avg_ms: float | None = None,
             threads_per_node: int = DEFAULT_THREADS_PER_NODE) -> None:
    """Check the inputs of :func:`plan` (``avg_ms`` only if given), e.g. before measuring it.

    Raises:
        ValidationError: as :func:`plan`, naming the argument.
    """
    _positive("peak_rate", peak_rate)
    if avg_ms is not None:
        _positive("avg_ms", avg_ms)
    if isinstance(threads_per_node, bool) or not isinstance(threads_per_node, int) \
            or threads_per_node < 1:
        raise ValidationError(f"threads_per_node must be a positive integer, "
                              f"got {threads_per_node!r}")


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValidationError(f"{name} must be a positive finite number, got {value!r}")


def percentile(ordered: Sequence[int], q: float) -> int:
    """The ``q``-th percentile (0 < q ≤ 100) of ``ordered`` (ascending) by nearest rank:
    the smallest value with at least ``q`` % of the values at or below it.

    Raises:
        ValueError: ``ordered`` is empty or ``q`` is out of range.
    """
    if not ordered:
        raise ValueError("no values")
    if not 0 < q <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {q!r}")
    return ordered[max(1, math.ceil(round(q / 100.0 * len(ordered), 9))) - 1]
