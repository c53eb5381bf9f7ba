"""Time on the test host.

Times in the fault suite are epoch milliseconds of the test host (the database runs on
the same clock); deadlines are taken on the monotonic clock (:func:`tests.waiting.wait_until`).
"""

from __future__ import annotations

import time

from tests.waiting import wait_until


def now_ms() -> int:
    return time.time_ns() // 1_000_000


#: the multi-host tests' name for the suite's one poll helper
poll = wait_until
