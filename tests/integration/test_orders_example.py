"""examples/orders: an order and its close task commit or roll back together, paying
cancels the task and extending moves it (both by the order number), and a real scheduler
and worker close an order left unpaid. PostgreSQL (the app's ``orders`` table sits in the
test's ax database, dropped afterwards); the last test also needs Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session, sessionmaker

import ax_kombu as ax
from ax_kombu import config, facade
from ax_kombu.config import from_env
from ax_kombu.worker.processors import Resolver
from examples.orders import app

from .harness import eventually, scheduler_running
from .test_worker import running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

HALF_HOUR_MS = 30 * 60 * 1000


@pytest.fixture
def shop(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    """The app on this test's database: its ``orders`` table, its sessions, and the
    process-wide ``ax`` API it calls pointed there (all put back afterwards)."""
    engine = create_engine(pg_url)
    app.Base.metadata.drop_all(engine)
    app.Base.metadata.create_all(engine)
    monkeypatch.setattr(app, "Sessions", sessionmaker(engine))
    monkeypatch.setattr(config, "process_overrides", {})
    monkeypatch.setattr(facade, "_client", None)
    ax.configure(database_url=pg_url)
    yield engine
    ax.configure()  # closes the client this test made; monkeypatch restores the rest
    app.Base.metadata.drop_all(engine)
    engine.dispose()


def _orders(engine: Engine) -> dict[int, str]:
    with engine.connect() as conn:
        return {order_id: status for order_id, status
                in conn.execute(text("SELECT id, status FROM orders"))}


def _close_task(engine: Engine, order_id: int) -> dict[str, Any] | None:
    """The order's close task as another session sees it (None: there is none)."""
    with engine.connect() as conn:
        row = conn.execute(text(
            "SELECT task_id, status, trigger_time, created_at, payload FROM ax_task "
            "WHERE task_type = 'order.close' AND biz_key = :key"),
            {"key": str(order_id)}).mappings().one_or_none()
    return None if row is None else dict(row)


def _status(engine: Engine, order_id: int) -> str | None:
    task = _close_task(engine, order_id)
    return None if task is None else str(task["status"])


def _place(engine: Engine, close_after: float = 1800) -> int:
    with Session(engine) as session, session.begin():
        return app.create_order(session, "alice", 1999, close_after).id


def test_an_order_whose_transaction_rolls_back_leaves_no_order_and_no_task(
        shop: Engine) -> None:
    with pytest.raises(RuntimeError), Session(shop) as session, session.begin():
        order = app.create_order(session, "alice", 1999)
        assert _close_task(shop, order.id) is None, "seen by another session before commit"
        raise RuntimeError("the payment provider is down")
    assert _orders(shop) == {}
    with shop.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM ax_task")).scalar_one() == 0


def test_a_committed_order_has_its_close_task_keyed_by_the_order_number(
        shop: Engine) -> None:
    order_id = _place(shop)
    assert _orders(shop) == {order_id: "unpaid"}
    task = _close_task(shop, order_id)
    assert task is not None and task["status"] == "DELAYED"
    assert abs(task["trigger_time"] - task["created_at"] - HALF_HOUR_MS) < 5_000
    assert ax.get(task["task_id"]).payload == {"order": order_id}


def test_paying_cancels_the_close_task(shop: Engine) -> None:
    order_id, other = _place(shop), _place(shop)
    assert app.pay_order(order_id) is True
    assert _orders(shop) == {order_id: "paid", other: "unpaid"}
    assert _status(shop, order_id) == "CANCELLED"
    assert _status(shop, other) == "DELAYED"
    assert app.pay_order(order_id) is False  # twice: nothing more happens


def test_extending_moves_the_close_task(shop: Engine) -> None:
    order_id = _place(shop)
    before = _close_task(shop, order_id)
    assert before is not None
    view = app.extend_order(order_id, 3600)  # an hour from now instead of half an hour
    after = _close_task(shop, order_id)
    assert after is not None and after["status"] == "DELAYED"
    assert abs(after["trigger_time"] - before["trigger_time"] - HALF_HOUR_MS) < 5_000
    assert [(m.from_time, m.to_time, m.kind) for m in view.moves] == [
        (before["trigger_time"], after["trigger_time"], "reschedule")]


def test_an_unpaid_order_is_closed_by_a_real_scheduler_and_worker(
        shop: Engine, pg_url: str, redis_broker: dict[str, str]) -> None:
    settings = from_env({}, database_url=pg_url, heartbeat_interval_s=0.2, **redis_broker)
    with running(settings, resolver=Resolver(modules=["examples.orders.app"])), \
            scheduler_running(settings):
        unpaid, paid = _place(shop, close_after=0.5), _place(shop, close_after=0.5)
        assert app.pay_order(paid)
        eventually(lambda: _orders(shop)[unpaid] == "closed", timeout=30,
                   what="the unpaid order closed")
        task = _close_task(shop, unpaid)
        assert task is not None
        eventually(lambda: ax.get(task["task_id"]).status is ax.Status.SUCCESS, timeout=10,
                   what="the close task recorded")
    assert ax.get(task["task_id"]).result == {"closed": True}
    assert _orders(shop) == {unpaid: "closed", paid: "paid"}
    assert _status(shop, paid) == "CANCELLED"
    assert app.pay_order(unpaid) is False  # too late: closed
    with pytest.raises(ax.IllegalTransition):
        app.extend_order(unpaid, 60)
