"""Exponential backoff with jitter for retries — pure, no I/O, no clock.

The n-th retry (``retry_count`` n = 0 for the first failure) waits

    ceiling(n) = min(cap_ms, base_ms · 2ⁿ)

shortened by a random share of at most ``jitter`` of it, so the delay lies in
``[ceiling · (1 − jitter), ceiling]``. The lower bound grows with n until the
cap, and many tasks that failed together (a downstream outage) do not all
come back in the same millisecond. The random source is passed in, so tests
use a seeded ``random.Random``.
"""

from __future__ import annotations

import random
from typing import Protocol


class Uniform(Protocol):
    """Anything with ``random() -> float`` in [0, 1), like :class:`random.Random`."""

    def random(self) -> float: ...


def ceiling_ms(retry_count: int, base_ms: int, cap_ms: int) -> int:
    """The un-jittered delay before retry number ``retry_count`` (0-based).

    Raises:
        ValueError: a negative argument.
    """
    if retry_count < 0 or base_ms < 0 or cap_ms < 0:
        raise ValueError("retry_count, base_ms and cap_ms must be >= 0")
    if base_ms == 0:
        return 0
    # 2**retry_count is exact for any int; stop doubling once past the cap.
    shift = min(retry_count, max(cap_ms // base_ms, 1).bit_length())
    return min(cap_ms, base_ms << shift)


def backoff_ms(retry_count: int, base_ms: int, cap_ms: int, rng: Uniform,
               jitter: float = 0.5) -> int:
    """The delay before retry number ``retry_count``: see the module docstring.

    Args:
        jitter: the share of the delay that is random, 0 (none) to 1 (full jitter).
    Raises:
        ValueError: a negative argument or ``jitter`` outside [0, 1].
    """
    if not 0.0 <= jitter <= 1.0:
        raise ValueError(f"jitter must be within [0, 1], got {jitter}")
    ceiling = ceiling_ms(retry_count, base_ms, cap_ms)
    return ceiling - int(ceiling * jitter * rng.random())


def default_rng() -> random.Random:
    """A fresh unseeded generator (for production use)."""
    return random.Random()
