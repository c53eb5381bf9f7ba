"""examples/fastapi_app: a FastAPI service enqueuing typed ``async def`` tasks from its
handlers (``await task.aenqueue(...)``), one of them in the request's own transaction,
run by a real scheduler and a real worker (``ax-worker -A examples.fastapi_app.tasks``).

The app runs in this process (FastAPI's TestClient runs its lifespan and requests on one
event loop); its table sits in the test's PostgreSQL database and is dropped afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

import ax_kombu as ax
from ax_kombu import config, facade

from .system import System

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from examples.fastapi_app import app as service

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture
def shop(pg_url: str, redis_broker: dict[str, str], tmp_path: Path,
         monkeypatch: pytest.MonkeyPatch) -> Iterator[System]:
    monkeypatch.setenv("AX_DATABASE_URL", pg_url)
    monkeypatch.setattr(config, "process_overrides", {})
    monkeypatch.setattr(facade, "_client", None)
    monkeypatch.setattr(service, "CLOSE_AFTER_S", 1.0)
    ax.configure(database_url=pg_url)
    system = System(pg_url, redis_broker, tmp_path)
    yield system
    system.close()
    ax.configure()
    with system.reader.begin() as conn:
        conn.execute(text("DROP TABLE IF EXISTS shop_order"))


def _orders(system: System) -> dict[str, tuple[int, str]]:
    return {customer: (order_id, status) for order_id, customer, status in system.query(
        "SELECT id, customer, status FROM shop_order")}


def _task(system: System, task_type: str, biz_key: str | None = None) -> tuple[int, str]:
    rows = system.query("SELECT task_id, status FROM ax_task WHERE task_type = :t "
                        "AND (biz_key = :k OR :k IS NULL)", t=task_type, k=biz_key)
    assert len(rows) == 1, rows
    return rows[0][0], rows[0][1]


def test_requests_enqueue_typed_async_tasks_in_their_transaction_and_a_worker_runs_them(
        shop: System) -> None:
    shop.scheduler("s0")
    shop.worker("w0", args=["-A", "examples.fastapi_app.tasks"])
    shop.wait_ready()
    with TestClient(service.app) as http:
        failed = http.post("/orders", json={"customer": "bob", "email": "b@example.com",
                                            "amount_cents": 500, "fail": True})
        assert failed.status_code == 503
        assert shop.query("SELECT count(*) FROM ax_task")[0][0] == 0, "the rollback kept a task"
        kept = http.post("/orders", json={"customer": "alice", "email": "a@example.com",
                                          "amount_cents": 1999}).json()["order"]
        paid = http.post("/orders", json={"customer": "carol", "email": "c@example.com",
                                          "amount_cents": 700}).json()["order"]
        assert _orders(shop) == {"alice": (kept, "unpaid"), "carol": (paid, "unpaid")}
        payment = http.post(f"/orders/{paid}/pay").json()
        assert payment["paid"] is True
        assert _task(shop, "shop.order.close", str(paid))[1] == "CANCELLED"

        shop.wait_for(lambda: _orders(shop)["alice"][1] == "closed", 30,
                      "the unpaid order closed by its async task")
        close_id = _task(shop, "shop.order.close", str(kept))[0]
        receipt_id = payment["receipt_task"]
        shop.wait_for(lambda: {_task(shop, "shop.order.close", str(kept))[1],
                               _task(shop, "shop.receipt.send")[1]} == {"SUCCESS"}, 30,
                      "both tasks recorded SUCCESS")
        answer = http.get(f"/tasks/{close_id}").json()
        assert answer["status"] == "SUCCESS" and answer["result"] is True
        receipt = http.get(f"/tasks/{receipt_id}").json()
        assert receipt["result"] == f"receipt {paid} sent to c@example.com"
        assert http.get("/tasks/1").status_code == 404
    assert shop.client.get(close_id).payload == {"order_id": kept}
    assert _orders(shop)["carol"][1] == "paid"
