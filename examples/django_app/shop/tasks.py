"""The shop's ax tasks, typed: ``close_order.enqueue(order_id, …)`` is checked against the
function's signature when it is called (and by mypy), and the worker calls the function
with the same arguments."""

from __future__ import annotations

import ax_kombu as ax
from shop.models import Order


@ax.task("shop.order.close", max_retry=3, timeout="30s")
def close_order(order_id: int, *, ctx: ax.Context) -> bool:
    """Close the order if it is still unpaid; True if this run closed it."""
    closed = Order.objects.filter(pk=order_id, status="unpaid").update(status="closed")
    ctx.log.info("order %s: %s", order_id, "closed" if closed else "already settled")
    return bool(closed)
