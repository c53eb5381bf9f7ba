"""Time on the test host, and waiting on a condition with a deadline.

Times in the fault suite are epoch milliseconds of the test host (the database runs on
the same clock); deadlines are taken on the monotonic clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def poll(check: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """``check()`` until it is true or ``timeout`` s passed; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)
