"""A host cut off between a statement and its COMMIT leaves its transaction open on the
server, holding its row locks until PostgreSQL notices the dead connection (hours, with the
default TCP keepalives). A heartbeat (or a listed-runs write) left so would lock its node's
row, and every scheduler's judging of that very node would wait on it, stopping their
housekeeping (a multi-host CI run saw judging stall). So a node's own row is written in
autocommit, and judging waits a bounded time for a lock. PostgreSQL only (SQLite is one
process)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from sqlalchemy import text, update
from sqlalchemy.exc import OperationalError

from ax_kombu.config import from_env
from ax_kombu.scheduler.liveness import JUDGE_LOCK_TIMEOUT_MS, Liveness
from ax_kombu.store import Store, nodes
from ax_kombu.store.engine import make_engine, one_statement
from ax_kombu.store.schema import nodes as node_table

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    made = Store(from_env({}, database_url=pg_url))
    yield made
    made.close()


def test_a_beat_holds_no_lock_once_it_answered(store: Store, pg_url: str) -> None:
    """While the beating connection is still open (as a cut host's would be), another
    session updates the same row at once: the beat committed before it answered."""
    beat = nodes.Heartbeat(store, "w0", "worker")
    beat.register({})
    other = make_engine(pg_url)
    try:
        with one_statement(store.engine) as conn:  # the beat's own way of writing
            conn.execute(beat._if_live(beat.incarnation).values(info="{}"))
            with other.begin() as probe:  # the connection above is still open here
                probe.execute(text("SET LOCAL lock_timeout = '200ms'"))
                moved = probe.execute(update(node_table).where(node_table.c.node_id == "w0")
                                      .values(info='{"probe": 1}')).rowcount
        assert moved == 1
        assert beat.beat({"after": 1})  # and a real beat still lands
    finally:
        other.dispose()


def test_judging_waits_a_bounded_time_for_a_locked_node_row(store: Store, pg_url: str) -> None:
    """A silent node's row locked by another open transaction (a cut host's orphaned
    one): the judging pass fails after its lock timeout instead of waiting for good."""
    silent = nodes.Heartbeat(store, "w9", "worker")
    silent.register({})
    with store.engine.begin() as conn:  # silent for a minute
        conn.execute(update(node_table).where(node_table.c.node_id == "w9")
                     .values(heartbeat_at=node_table.c.heartbeat_at - 60_000))
    settings = from_env({}, database_url=pg_url)
    judge = Liveness(settings, store, nodes.Heartbeat(store, "s0", "scheduler"),
                     info=dict, on_fenced=lambda: None, wake=lambda: None)
    with store.engine.connect() as orphan:
        orphan.execute(text("SELECT 1 FROM ax_node WHERE node_id = 'w9' FOR UPDATE"))
        began = time.monotonic()
        with pytest.raises(OperationalError, match="lock timeout"):
            judge._judge(store.now_ms())
        waited = time.monotonic() - began
        orphan.rollback()
    assert waited < JUDGE_LOCK_TIMEOUT_MS / 1000 + 5
    judge._judge(store.now_ms())  # the lock gone, the node is judged dead
    with store.engine.connect() as conn:
        stopped = conn.execute(text("SELECT stopped_at FROM ax_node WHERE node_id = 'w9'"))
        assert stopped.scalar() is not None
