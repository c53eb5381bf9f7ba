"""A claim whose reply was lost is resumed, not left DISPATCHING until the ack timeout
(issue 22 item 6): the claim statement's resume form on SQLite and PostgreSQL, and the
claimer in a scheduler on PostgreSQL + Redis with the reply lost at the connection."""

from __future__ import annotations

from typing import Any

import psycopg2
import pytest
from sqlalchemy import Engine, event

from ax_kombu.api import Client
from ax_kombu.config import from_env
from ax_kombu.store.claims import claim

from .harness import collecting, scheduler_running

pytestmark = [pytest.mark.timeout(120)]


def test_a_resumed_claim_returns_what_the_lost_one_moved_and_nothing_else(
        client: Client) -> None:
    ids = [int(i) for i in client.enqueue_many([{"task_type": "t", "payload": {"i": i}}
                                                for i in range(6)])]
    now = client.store.now_ms() + 1000
    with client.store.engine.begin() as conn:
        lost = claim(conn, ids[:4], "s1", now)  # its reply "lost": the caller never saw it
        assert sorted(r.task_id for r in lost) == ids[:4]
        # another claim of the node (a later now) and a claim of another node
        other = claim(conn, ids[4:5], "s1", now + 1)
        assert [r.task_id for r in other] == ids[4:5]
        assert claim(conn, ids[:5], "s2", now, resume=True) == []
        assert claim(conn, ids[:5], "s1", now + 3, resume=True) == []
        resumed = claim(conn, ids, "s1", now, resume=True)
    # the lost claim's rows at the attempt it gave them, and the one it never reached
    assert sorted((r.task_id, r.attempt) for r in resumed) == [
        *[(i, 1) for i in ids[:4]], (ids[5], 1)]
    again = {i: client.get(i) for i in ids}
    assert {v.attempt for v in again.values()} == {1}
    assert {v.dispatched_at for i, v in again.items() if i != ids[4]} == {now}


@pytest.mark.integration
def test_the_claimer_publishes_a_claim_whose_reply_was_lost(
        pg_url: str, redis_broker: dict[str, str]) -> None:
    """The first claim statement commits, then its connection drops before the answer (a
    disconnect error raised right after the statement ran, on the claimer's autocommit
    connection). Before: its rows stayed DISPATCHING until the ack timeout (30 s here);
    now the retry finds them (DISPATCHING, this node, the claim's now) and publishes them,
    each once, at the attempt the lost statement gave them."""
    cfg = from_env({}, database_url=pg_url, heartbeat_interval_s=0.5, **redis_broker)
    client = Client(cfg)
    lost: list[str] = []

    def lose_reply(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if not lost and "SET status = 'DISPATCHING'" in statement:
            lost.append(statement)
            raise psycopg2.OperationalError("server closed the connection unexpectedly")

    try:
        ids = sorted(int(i) for i in client.enqueue_many(
            [{"task_type": "t", "payload": {"i": i}, "delay": 0.3} for i in range(200)]))
        event.listen(Engine, "after_cursor_execute", lose_reply)
        try:
            with collecting(cfg) as got, scheduler_running(cfg):
                arrived = got.wait_for(lambda: len(got.got) >= len(ids), timeout=8)
                assert lost, "no claim statement ran"
                assert arrived, (f"{len(got.got)} of {len(ids)} published; statuses "
                                 f"{sorted({client.get(i).status for i in ids})}")
        finally:
            event.remove(Engine, "after_cursor_execute", lose_reply)
        assert sorted(got.ids()) == ids  # each once
        assert {r.body["attempt"] for r in got.got} == {1}
        assert cfg.ack_timeout_ms >= 30_000  # what the rows waited for before
    finally:
        client.close()
