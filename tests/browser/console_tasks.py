"""The processors the browser test runs in a real ``ax-worker``
(``-A tests.browser.console_tasks``).

* ``web.flaky`` fails on its first attempt and succeeds on any later one, so a task
  retried from the console ends SUCCESS;
* ``web.tick`` does nothing: the recurring job's occurrences, and the tasks that fill
  the overview's charts.
"""

from __future__ import annotations

from typing import Any

import ax_kombu as ax
from ax_kombu.worker.processors import Context

FAILURE = "planned failure on the first attempt"


@ax.processor("web.flaky")
def flaky(payload: Any, ctx: Context) -> None:
    if ctx.attempt == 1:
        raise RuntimeError(FAILURE)


@ax.processor("web.tick")
def tick(payload: Any, ctx: Context) -> None:
    return None
