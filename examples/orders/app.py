"""Orders that close themselves when unpaid: ax inside an application's own transactions.

An order and its ``order.close`` task are written in one transaction (``connection=``):
both exist, or neither. The task's ``biz_key`` is the order number, so paying cancels it
and extending moves it by that number; the app keeps no task ids. Paying and closing each
lock the order row and check its status, so whichever comes second does nothing.

The app's ``orders`` table lives in ax's own PostgreSQL database (``AX_DATABASE_URL``):
one transaction can only span one database. ``README.md`` here says how to run it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from sqlalchemy import String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import ax_kombu as ax

#: how long an order may stay unpaid before it is closed
CLOSE_AFTER = timedelta(minutes=30)

#: the app's database, which is ax's (nothing connects until a session is used)
engine = create_engine(os.environ.get("AX_DATABASE_URL",
                                      "postgresql://postgres@127.0.0.1:5432/orders"))
Sessions = sessionmaker(engine)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))
    amount_cents: Mapped[int]
    status: Mapped[str] = mapped_column(String(10), default="unpaid")  # paid | closed


def create_order(session: Session, customer: str, amount_cents: int,
                 close_after: float | timedelta = CLOSE_AFTER) -> Order:
    """Add an order and its close task inside ``session``'s transaction: both commit or
    roll back with it.

    Args:
        close_after: seconds (or a timedelta) until the order closes if still unpaid.
    """
    order = Order(customer=customer, amount_cents=amount_cents, status="unpaid")
    session.add(order)
    session.flush()  # the order number, for the task's biz_key
    ax.enqueue("order.close", {"order": order.id}, delay=close_after,
               biz_key=str(order.id), connection=session)
    return order


def pay_order(order_id: int) -> bool:
    """Mark the order paid, then cancel its close task; False if it was not unpaid
    (already paid, or closed)."""
    with Sessions.begin() as session:
        order = session.get(Order, order_id, with_for_update=True)
        if order is None or order.status != "unpaid":
            return False
        order.status = "paid"
    try:
        ax.cancel(task_type="order.close", biz_key=str(order_id))
    except ax.IllegalTransition:
        pass  # it ran meanwhile, found the order paid and left it
    return True


def extend_order(order_id: int, delay: float | timedelta) -> ax.TaskView:
    """Give the customer ``delay`` (seconds or a timedelta) from now to pay.

    Raises:
        ax.TooLateToMove: the close is already under way.
        ax.IllegalTransition: the close task has finished (it ran, or was cancelled).
    """
    return ax.reschedule(task_type="order.close", biz_key=str(order_id), delay=delay)


@ax.processor("order.close")
def close_order(payload: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Close the order if it is still unpaid; the result says whether it did."""
    with Sessions.begin() as session:
        order = session.get(Order, payload["order"], with_for_update=True)
        if order is None or order.status != "unpaid":
            return {"closed": False}
        order.status = "closed"
    return {"closed": True}
