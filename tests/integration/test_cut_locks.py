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

from ax_kombu.api import Client
from ax_kombu.config import from_env
from ax_kombu.scheduler.liveness import JUDGE_LOCK_TIMEOUT_MS, Liveness
from ax_kombu.store import Store, nodes, recovery
from ax_kombu.store.engine import make_engine, one_statement
from ax_kombu.store.schema import nodes as node_table
from ax_kombu.store.schema import tasks

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


@pytest.fixture
def client(pg_url: str) -> Iterator[Client]:
    made = Client(from_env({}, database_url=pg_url))
    yield made
    made.close()


def _running_on(client: Client, node: str, n: int) -> list[int]:
    """``n`` due tasks RUNNING on ``node`` at attempt 1."""
    store = client.store
    ids = [int(client.enqueue("cut.t", {"i": i, "node": node})) for i in range(n)]
    with store.engine.begin() as conn:
        conn.execute(update(tasks).where(tasks.c.task_id.in_(ids))
                     .values(status="RUNNING", owner_node=node, attempt=1, max_retry=3))
    return ids


def _status(store: Store, ids: list[int]) -> dict[int, str]:
    with store.engine.connect() as conn:
        return dict(conn.execute(text("SELECT task_id, status FROM ax_task "
                                      "WHERE task_id = ANY(:ids)"), {"ids": ids}).all())


@pytest.mark.parametrize("orphan_ends", ["commit", "rollback"])
def test_judging_recovers_around_a_row_an_orphaned_transaction_holds(
        client: Client, pg_url: str, orphan_ends: str) -> None:
    """A dead worker's RUNNING row locked by another open transaction (its own outcome,
    whose COMMIT a cut left in flight): judging declares the node dead and recovers its
    other runs at once, without waiting for the lock; the locked row is left as it is. Once
    that transaction ends, the recovery scan recovers the row if it rolled back, and leaves
    the outcome it committed."""
    store = client.store
    silent = nodes.Heartbeat(store, "w9", "worker")
    silent.register({})
    locked, *others = _running_on(client, "w9", 3)
    with store.engine.begin() as conn:
        conn.execute(update(node_table).where(node_table.c.node_id == "w9")
                     .values(heartbeat_at=node_table.c.heartbeat_at - 60_000))
    judge = Liveness(from_env({}, database_url=pg_url), store,
                     nodes.Heartbeat(store, "s0", "scheduler"),
                     info=dict, on_fenced=lambda: None, wake=lambda: None)
    with store.engine.connect() as orphan:
        orphan.execute(update(tasks).where(tasks.c.task_id == locked)
                       .values(status="SUCCESS", owner_node=None))
        began = time.monotonic()
        judge._judge(store.now_ms())  # no lock timeout: the locked row is not waited for
        assert time.monotonic() - began < JUDGE_LOCK_TIMEOUT_MS / 1000
        assert _status(store, [locked, *others]) == {locked: "RUNNING",
                                                    **dict.fromkeys(others, "DELAYED")}
        with store.engine.begin() as conn:  # the recovery scan, while it is still locked
            assert recovery.recover_orphan_running(conn, store.now_ms(), store.now_ms()) == []
        (orphan.commit if orphan_ends == "commit" else orphan.rollback)()
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT stopped_at FROM ax_node WHERE node_id = 'w9'")
                            ).scalar() is not None
    with store.engine.begin() as conn:
        rescued = recovery.recover_orphan_running(conn, store.now_ms(), store.now_ms())
        lost = conn.execute(text("SELECT task_id FROM ax_attempt WHERE outcome = 'LOST'")
                            ).scalars().all()
    if orphan_ends == "commit":
        assert rescued == [] and _status(store, [locked]) == {locked: "SUCCESS"}
        assert sorted(lost) == sorted(others)
    else:
        assert rescued == [(locked, "DELAYED")] and _status(store, [locked]) == {locked: "DELAYED"}
        assert sorted(lost) == sorted([locked, *others])


def test_the_ack_timeout_scan_leaves_a_dispatch_another_transaction_holds(
        client: Client) -> None:
    """A DISPATCHING row past its ack timeout, locked by another open transaction (a
    worker's start in flight): the scan requeues the others and leaves it."""
    store = client.store
    ids = [int(client.enqueue("cut.d", {"i": i})) for i in range(3)]
    past = store.now_ms() - 600_000
    with store.engine.begin() as conn:
        conn.execute(update(tasks).where(tasks.c.task_id.in_(ids))
                     .values(status="DISPATCHING", owner_node="s1", attempt=1,
                             dispatched_at=past))
    with store.engine.connect() as orphan:
        orphan.execute(update(tasks).where(tasks.c.task_id == ids[0]).values(status="RUNNING"))
        with store.engine.begin() as conn:
            conn.execute(text("SET LOCAL lock_timeout = '1s'"))
            moved = recovery.redispatch_unacked(conn, store.now_ms(), 1000, ["default"], 5)
        orphan.rollback()
    assert sorted(moved) == sorted((t, "READY") for t in ids[1:])
    assert _status(store, ids) == {ids[0]: "DISPATCHING", ids[1]: "READY", ids[2]: "READY"}
