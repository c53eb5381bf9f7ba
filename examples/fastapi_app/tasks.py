"""The service's ax tasks, typed and ``async def``: the worker runs them on its event loop
(``ax-worker -A examples.fastapi_app.tasks``), each bounded by its lane's slots and its
timeout like any run."""

from __future__ import annotations

import os

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import ax_kombu as ax


def async_url(url: str) -> str:
    """``postgresql://…`` as SQLAlchemy's async psycopg 3 URL."""
    return url.replace("postgresql://", "postgresql+psycopg://", 1)


_engine: AsyncEngine | None = None


def engine() -> AsyncEngine:
    """The app's database (ax's own, so an order and its task share a transaction)."""
    global _engine
    if _engine is None:
        _engine = create_async_engine(async_url(os.environ["AX_DATABASE_URL"]))
    return _engine


@ax.task("shop.order.close", timeout="30s", max_retry=3)
async def close_order(order_id: int, *, ctx: ax.Context) -> bool:
    """Close the order if it is still unpaid; True if this run closed it."""
    async with engine().begin() as conn:
        closed = await conn.execute(text(
            "UPDATE shop_order SET status = 'closed' WHERE id = :id AND status = 'unpaid'"),
            {"id": order_id})
    ctx.log.info("order %s: %s", order_id, "closed" if closed.rowcount else "already settled")
    return bool(closed.rowcount)


@ax.task("shop.receipt.send", priority="high", timeout="10s")
async def send_receipt(order_id: int, email: str, *, ctx: ax.Context) -> str:
    """Stand-in for a mail API call (awaited I/O: no thread is held while it waits)."""
    ctx.log.info("receipt for order %s to %s", order_id, email)
    return f"receipt {order_id} sent to {email}"
