"""Processors the end-to-end tests run in real ``ax-worker`` processes (``-A tests.e2e.e2e_tasks``).

One processor, ``e2e.task``, steered by its payload:

* ``log``: a file, the run ledger (:mod:`tests.ledger`): every run appends its start line
  *before doing anything else* and its end line when it returns or raises, so the test
  can count how many times each task really ran, and when;
* ``sleep``: seconds to sleep;
* ``fail``: the number of first runs that raise (``retry_count < fail``).
"""

from __future__ import annotations

import time
from typing import Any

import ax_kombu as ax
from ax_kombu.worker.processors import Context
from tests.ledger import recording


@ax.processor("e2e.task")
def task(payload: dict[str, Any], ctx: Context) -> None:
    if not payload.get("log"):
        _work(payload, ctx)
        return
    with recording(payload["log"], ctx):
        _work(payload, ctx)


def _work(payload: dict[str, Any], ctx: Context) -> None:
    if ctx.retry_count < int(payload.get("fail", 0)):
        raise RuntimeError(f"planned failure #{ctx.retry_count + 1}")
    if payload.get("sleep"):
        time.sleep(float(payload["sleep"]))
