"""The issue-14 metrics that come from the store, on SQLite and PostgreSQL: the oldest
overdue task (it rises with nothing published), and duplicates by kind."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import update

from ax_kombu.api import Client
from ax_kombu.config import from_env
from ax_kombu.store import recovery
from ax_kombu.store.schema import tasks

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def client(store_url: str) -> Iterator[Client]:
    c = Client(from_env({}, database_url=store_url, auto_migrate=True))
    yield c
    c.close()


def _at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def test_the_oldest_overdue_task_counts_what_waits_and_not_what_is_parked(
        client: Client) -> None:
    now = client.store.now_ms()
    with client.store.engine.connect() as conn:
        assert recovery.oldest_overdue_ms(conn, now) == 0
    old, parked, later = (int(client.enqueue("m.t", {"i": i}, run_at=_at(now + d)))
                          for i, d in enumerate((5_000, 1_000, 30_000)))
    with client.store.engine.begin() as conn:
        conn.execute(update(tasks).where(tasks.c.task_id == parked)
                     .values(status="READY", parked=True))
        conn.execute(update(tasks).where(tasks.c.task_id == old).values(status="READY"))
        # 12 s on: 'old' (due at +5 s) waits 7 s; 'parked' waits by design; 'later' is not due
        assert recovery.oldest_overdue_ms(conn, now + 12_000) == 7_000
        # published and waiting in the broker is still waiting; started is not
        conn.execute(update(tasks).where(tasks.c.task_id == old).values(status="DISPATCHING"))
        assert recovery.oldest_overdue_ms(conn, now + 12_000) == 7_000
        conn.execute(update(tasks).where(tasks.c.task_id == old).values(status="RUNNING"))
        assert recovery.oldest_overdue_ms(conn, now + 12_000) == 0
    assert later


def _dedups(kind: str) -> float:
    return REGISTRY.get_sample_value("ax_dedup_total", {"kind": kind}) or 0.0


def test_duplicates_are_counted_by_kind(client: Client) -> None:
    by_key, by_fp = _dedups("biz_key"), _dedups("fingerprint")
    client.enqueue("m.d", {"a": 1}, biz_key="k1")
    assert client.enqueue("m.d", {"a": 2}, biz_key="k1").duplicate
    client.enqueue("m.d", {"b": 1})
    assert client.enqueue("m.d", {"b": 1}).duplicate
    assert client.enqueue("m.d", {"b": 1}).duplicate
    assert (_dedups("biz_key") - by_key, _dedups("fingerprint") - by_fp) == (1, 2)
