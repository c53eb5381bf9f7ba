"""Processors for the demo: what an application registers with ``@ax.processor``.

The worker imports this module because it is started with ``-A demo_tasks``.
"""

from __future__ import annotations

from typing import Any

import ax_kombu as ax

_attempts: dict[int, int] = {}


@ax.processor("coupon.grant")
def grant_coupon(payload: dict[str, Any], ctx: Any) -> None:
    """Instant: a coupon for one user."""


@ax.processor("order.close")
def close_order(payload: dict[str, Any], ctx: Any) -> None:
    """Close an unpaid order (a short piece of work)."""


@ax.processor("push.flaky")
def flaky_push(payload: dict[str, Any], ctx: Any) -> None:
    """Fails on its first attempt, to show a retry with backoff."""
    if ctx.attempt == 1:
        raise RuntimeError("push gateway said 503")
