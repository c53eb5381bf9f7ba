"""Exponential backoff with jitter for retries — pure, no I/O, no clock.

The n-th retry (``retry_count`` n = 0 for the first failure) waits

    ceiling(n) = min(cap_ms, base_ms · 2ⁿ)

shortened by a random share of at most ``jitter`` of it, so the delay lies in
``[ceiling · (1 − jitter), ceiling]``. The lower bound grows with n until the
cap, and many tasks that failed together (a downstream outage) do not all
come back in the same millisecond. The random source is passed in, so tests
use a seeded ``random.Random``.

A task type may have its own: :class:`Backoff` (``ax.Backoff``, in seconds), given to
``@ax.processor(…, backoff=…)``, replaces the worker's ``AX_RETRY_BACKOFF_*`` for it; it
travels in the type's :class:`RetryPolicy` with the exceptions it retries (``retry_on``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ax_kombu.core.errors import MAX_DELAY_S, ValidationError


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


@dataclass(frozen=True, slots=True)
class Backoff:
    """A task type's own back-off (``ax.Backoff``): retry n waits ``min(cap, base · 2ⁿ)``
    seconds, shortened by a random share of at most ``jitter`` of it.

    Raises:
        ValidationError: ``base`` or ``cap`` not a number of seconds within
            0..3650 days, ``cap`` below ``base``, or ``jitter`` outside [0, 1].
    """

    base: float = 1.0
    cap: float = 600.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        for name in ("base", "cap", "jitter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ValidationError(f"Backoff {name} must be a finite number, got {value!r}")
        if not 0 <= self.base <= self.cap <= MAX_DELAY_S:
            raise ValidationError("Backoff needs 0 <= base <= cap <= 3650 days (seconds), got "
                                  f"base={self.base}, cap={self.cap}")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValidationError(f"Backoff jitter must be within [0, 1], got {self.jitter}")

    def delay_ms(self, retry_count: int, rng: Uniform) -> int:
        """The delay before retry number ``retry_count`` (0-based), in ms."""
        return backoff_ms(retry_count, round(self.base * 1000), round(self.cap * 1000), rng,
                          self.jitter)


class RetryPolicy(NamedTuple):
    """What a failure means for one processor (``@ax.processor(…, retry_on=…, backoff=…)``;
    applied by :func:`ax_kombu.core.outcomes.decide`)."""

    #: only these exceptions are retried (None: any); ``ax.Retry``, ``ax.Snooze`` and
    #: ``ax.Discard`` keep their meaning whatever this holds
    retry_on: tuple[type[BaseException], ...] | None = None
    #: replaces ``AX_RETRY_BACKOFF_*`` for this processor's tasks (None: those)
    backoff: Backoff | None = None
