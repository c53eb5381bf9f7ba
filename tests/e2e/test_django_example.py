"""examples/django_app: a Django project that enqueues a typed ax task inside
``transaction.atomic()`` and whose tasks run on ``ax-worker -A shopsite.ax_worker``.

Everything Django runs in its own processes (``manage.py migrate``, ``manage.py shell``,
the worker), as a user's project does, so no Django settings leak into this test process.
The shop's table lives in the test's PostgreSQL database, next to ax's, and is dropped
afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from .system import REPO, System

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PROJECT = REPO / "examples" / "django_app"

#: placed through Django's test client in the project's own process; prints what it got
_PLACE = """
import json
from django.test import Client
client = Client(raise_request_exception=False)
out = {}
for name, fail in (("kept", False), ("rolled_back", True), ("paid", False)):
    answer = client.post("/orders/", json.dumps({"customer": name, "amount_cents": 1999,
                                                 "fail": fail}),
                         content_type="application/json")
    out[name] = [answer.status_code, answer.json() if answer.status_code == 201 else None]
paid = out["paid"][1]["order"]
out["pay"] = client.post(f"/orders/{paid}/pay/").json()
print("RESULT " + json.dumps(out))
"""


def _manage(system: System, *args: str) -> str:
    env = system.daemon_env()
    env["DJANGO_SETTINGS_MODULE"] = "shopsite.settings"
    env["ORDER_CLOSE_AFTER_S"] = "1"
    done = subprocess.run([sys.executable, "manage.py", *args], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture
def shop(pg_url: str, redis_broker: dict[str, str], tmp_path: Path,
         monkeypatch: pytest.MonkeyPatch) -> Iterator[System]:
    # the worker imports the project from its directory, with Django's settings
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(PROJECT), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "shopsite.settings")
    system = System(pg_url, redis_broker, tmp_path)
    _manage(system, "migrate", "--noinput")
    yield system
    system.close()
    with system.reader.begin() as conn:
        conn.execute(text("DROP TABLE IF EXISTS shop_order, django_migrations, "
                          "django_content_type CASCADE"))


def _orders(system: System) -> dict[str, tuple[int, str]]:
    return {customer: (order_id, status) for order_id, customer, status in system.query(
        "SELECT id, customer, status FROM shop_order")}


def _close_task(system: System, order_id: int) -> tuple[int, str] | None:
    rows = system.query("SELECT task_id, status FROM ax_task WHERE task_type = "
                        "'shop.order.close' AND biz_key = :key", key=str(order_id))
    return (rows[0][0], rows[0][1]) if rows else None


def test_orders_and_close_tasks_commit_together_and_a_real_worker_closes_the_unpaid(
        shop: System) -> None:
    shop.scheduler("s0")
    shop.worker("w0", args=["-A", "shopsite.ax_worker"])
    shop.wait_ready()
    out = _manage(shop, "shell", "-c", _PLACE)
    placed = json.loads(out.split("RESULT ", 1)[1])
    assert placed["kept"][0] == 201 and placed["paid"][0] == 201
    assert placed["rolled_back"] == [500, None]
    assert placed["pay"] == {"paid": True}

    orders = _orders(shop)
    assert set(orders) == {"kept", "paid"}, "the failed request left its order behind"
    kept, paid = orders["kept"][0], orders["paid"][0]
    assert shop.query("SELECT count(*) FROM ax_task")[0][0] == 2, "one task per kept order"
    paid_task = _close_task(shop, paid)
    assert paid_task is not None and paid_task[1] == "CANCELLED"

    shop.wait_for(lambda: _orders(shop)["kept"][1] == "closed", 30, "the unpaid order closed")
    kept_task = _close_task(shop, kept)
    assert kept_task is not None
    shop.wait_for(lambda: _close_task(shop, kept) == (kept_task[0], "SUCCESS"), 10,
                  "its close task recorded SUCCESS")
    assert shop.client.get(kept_task[0]).payload == {"order_id": kept}
    assert shop.client.get(kept_task[0]).result is True
    assert _orders(shop)["paid"][1] == "paid"
