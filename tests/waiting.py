"""Waiting on a condition with a deadline: the one poll helper of the test suite.

A test that waits for something another thread or process does polls it here, against a
deadline on the monotonic clock, instead of sleeping a fixed time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.05) -> T:
    """Call ``predicate`` until it returns something true or ``timeout`` seconds have passed.

    Args:
        predicate: what to look at; called at least once, and once more at the deadline.
        timeout: seconds from now.
        interval: seconds between two calls.

    Returns:
        The predicate's last value: true if it came in time, its false value otherwise.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


def eventually(predicate: Callable[[], T], timeout: float = 20.0, what: str = "condition",
               interval: float = 0.02) -> T:
    """:func:`wait_until`, failing the test if ``predicate`` never came true.

    Returns:
        The predicate's first true value.

    Raises:
        AssertionError: naming ``what``, after ``timeout`` seconds.
    """
    value = wait_until(predicate, timeout, interval)
    if not value:
        raise AssertionError(f"{what} not reached within {timeout:g}s")
    return value
