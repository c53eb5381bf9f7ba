"""A FastAPI service that schedules typed ax tasks without blocking its event loop.

* The lifespan opens the loop's async ax client (``ax.aio.client()``) and closes it.
* ``POST /orders`` writes the order and its close task in the request's own database
  transaction (``connection=session``): both commit, or neither.
* ``POST /orders/{id}/pay`` marks it paid, cancels the close task by its business key, and
  enqueues a receipt.
* ``GET /tasks/{id}`` reads a task back.

Run it: ``uvicorn examples.fastapi_app.app:app`` with ``AX_DATABASE_URL`` on PostgreSQL
(the README beside this file has the whole set of commands).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.ext.asyncio import async_sessionmaker

import ax_kombu as ax
from examples.fastapi_app.tasks import close_order, engine, send_receipt

#: seconds an order may stay unpaid before its close task runs
CLOSE_AFTER_S = float(os.environ.get("ORDER_CLOSE_AFTER_S", "1800"))

SCHEMA = ("CREATE TABLE IF NOT EXISTS shop_order (id BIGSERIAL PRIMARY KEY, "
          "customer TEXT NOT NULL, email TEXT NOT NULL, amount_cents INTEGER NOT NULL, "
          "status TEXT NOT NULL DEFAULT 'unpaid')")


class NewOrder(BaseModel):
    customer: str
    email: str
    amount_cents: int
    #: make the request fail after the order and its task were written (a demo of rollback)
    fail: bool = False


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with engine().begin() as conn:
        await conn.execute(text(SCHEMA))
    app.state.ax = ax.aio.client()  # this loop's client: async enqueue, get, wait, cancel
    app.state.sessions = async_sessionmaker(engine())
    yield
    await ax.aio.aclose()
    await engine().dispose()


app = FastAPI(lifespan=lifespan)


@app.post("/orders", status_code=201)
async def create_order(order: NewOrder) -> dict[str, int]:
    async with app.state.sessions() as session, session.begin():
        order_id = (await session.execute(text(
            "INSERT INTO shop_order (customer, email, amount_cents) "
            "VALUES (:c, :e, :a) RETURNING id"),
            {"c": order.customer, "e": order.email, "a": order.amount_cents})).scalar_one()
        await close_order.aenqueue(order_id, delay=CLOSE_AFTER_S, biz_key=str(order_id),
                                   connection=session)
        if order.fail:  # the session's transaction rolls back: no order, no task
            raise HTTPException(503, "the payment provider is down")
    return {"order": order_id}


@app.post("/orders/{order_id}/pay")
async def pay_order(order_id: int) -> dict[str, Any]:
    async with app.state.sessions() as session, session.begin():
        row = (await session.execute(text(
            "UPDATE shop_order SET status = 'paid' WHERE id = :id AND status = 'unpaid' "
            "RETURNING email"), {"id": order_id})).first()
    if row is None:
        return {"paid": False}
    await app.state.ax.cancel(task_type=close_order.task_type, biz_key=str(order_id))
    receipt = await send_receipt.aenqueue(order_id, row.email)
    return {"paid": True, "receipt_task": int(receipt)}


@app.get("/tasks/{task_id}")
async def task(task_id: int) -> dict[str, Any]:
    try:
        view = await app.state.ax.get(task_id)
    except ax.TaskNotFound:
        raise HTTPException(404, f"no task {task_id}") from None
    return {"task_id": view.task_id, "task_type": view.task_type,
            "status": str(view.status), "result": view.result}
