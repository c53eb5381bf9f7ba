"""``ax status``'s count by status (:func:`ax_kombu.store.console.task_counts`): exact up
to a bound per status, estimated from the planner's statistics above it, so it never
reads millions of finished tasks one by one."""

from __future__ import annotations

import pytest
from sqlalchemy import text, update

from ax_kombu.api import Client
from ax_kombu.store.console import task_counts
from ax_kombu.store.schema import tasks

pytestmark = [pytest.mark.integration]


def test_small_counts_are_exact_and_large_ones_estimated(client: Client) -> None:
    ids = client.enqueue_many([{"task_type": "t", "payload": {"i": i}, "delay": 3600}
                               for i in range(1600)])
    with client.store.engine.begin() as conn:
        conn.execute(update(tasks).where(tasks.c.task_id.in_(ids[:1500])).values(status="SUCCESS"))
        conn.execute(update(tasks).where(tasks.c.task_id.in_(ids[1500:1503]))
                     .values(status="RUNNING", owner_node="w"))
        if conn.dialect.name == "postgresql":
            conn.execute(text("ANALYZE ax_task"))
    with client.store.engine.connect() as conn:
        exact, none = task_counts(conn, exact_up_to=2000)
        counts, estimated = task_counts(conn, exact_up_to=100)
    assert none == set()
    assert (exact["SUCCESS"], exact["DELAYED"], exact["RUNNING"], exact["READY"]) == (
        1500, 97, 3, 0)
    assert counts["RUNNING"] == 3 and counts["DELAYED"] == 97 and counts["READY"] == 0
    if client.store.engine.dialect.name == "postgresql":
        assert estimated == {"SUCCESS"}
        assert 1200 <= counts["SUCCESS"] <= 1800  # the statistics' share of the row estimate
    else:  # SQLite counts exactly
        assert estimated == set() and counts["SUCCESS"] == 1500


def test_postgresql_connections_never_jit_compile(client: Client) -> None:
    """The schedule delays ``ax status`` reads spent 20 ms in PostgreSQL's JIT compiler on
    a 10M-row table (its estimate, not its work, passed ``jit_above_cost``): every
    connection ax opens turns JIT off, pooled and autocommit alike."""
    engine = client.store.engine
    if engine.dialect.name != "postgresql":
        pytest.skip("JIT is PostgreSQL's")
    with engine.connect() as conn:
        assert conn.execute(text("SHOW jit")).scalar_one() == "off"
    with engine.connect() as plain:
        conn = plain.execution_options(isolation_level="AUTOCOMMIT")
        assert conn.execute(text("SHOW jit")).scalar_one() == "off"
        assert conn.execute(text("SELECT current_setting('jit', true)")).scalar_one() == "off"
