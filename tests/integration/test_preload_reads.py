"""The preload reads and never writes (issue 21: at most 4 row versions per task): what a
round returns, what the next round returns after rows became claimable again, a writer
that commits after the round's snapshot, ties at the last instant, and the shares.

On SQLite and PostgreSQL unless marked; the late-commit case is PostgreSQL's (SQLite has
one writer at a time)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.store import preload
from ax_kombu.store.claims import claim
from ax_kombu.store.preload import Loaded, Share

pytestmark = [pytest.mark.timeout(60)]


def _enqueue(client: Client, n: int, delay: float = 5.0, tag: str = "") -> list[int]:
    """``n`` tasks due in ``delay`` s (payloads differ from other tags': no duplicate)."""
    out = client.enqueue_many([{"task_type": "t", "payload": {"i": i, "tag": tag},
                                "delay": delay} for i in range(n)])
    assert all(t.created for t in out)
    return sorted(int(i) for i in out)


def _round(client: Client, loaded: Loaded, horizon: int, limit: int = 1000,
           share: Share = preload.ALL) -> tuple[list[int], Loaded]:
    with client.store.engine.begin() as conn:
        rows, after = preload.preload(conn, loaded, horizon, limit, share)
    return sorted(task_id for task_id, _ in rows), after


def _versions(client: Client) -> list[tuple[Any, ...]]:
    """Each row's id, status and holder; on PostgreSQL also the transaction that wrote the
    version (``xmin``): a write of the same values would show there."""
    xmin = ", xmin::text" if client.store.engine.dialect.name == "postgresql" else ""
    with client.store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(
            f"SELECT task_id, status, owner_node{xmin} FROM ax_task ORDER BY task_id"))]


def test_a_round_reads_the_window_and_writes_nothing(client: Client) -> None:
    ids = _enqueue(client, 20)
    far = sorted(int(i) for i in client.enqueue_many(
        [{"task_type": "t", "payload": {"far": i}, "delay": 120} for i in range(3)]))
    before = _versions(client)
    assert {row[1] for row in before} == {"DELAYED"}  # written so by enqueue
    horizon = client.store.now_ms() + 10_000
    got, loaded = _round(client, Loaded(), horizon)
    assert got == ids and not set(far) & set(got)
    assert loaded.until == horizon and loaded.mark is not None
    assert _versions(client) == before
    again, _ = _round(client, loaded, horizon + 1)
    assert again == []  # nothing new: the band moved past them, nothing changed


def test_rows_that_become_claimable_again_inside_the_window_are_read(client: Client) -> None:
    ids = _enqueue(client, 6)
    now = client.store.now_ms()
    horizon = now + 10_000
    got, loaded = _round(client, Loaded(), horizon)
    assert got == ids
    with client.store.engine.begin() as conn:  # three are claimed; two come back
        claimed = [r.task_id for r in claim(conn, ids[:3], "s1", now, due_before=horizon)]
        conn.execute(text("UPDATE ax_task SET status = 'READY', owner_node = NULL "
                          "WHERE task_id IN (:a, :b)"), {"a": claimed[0], "b": claimed[1]})
    assert len(claimed) == 3
    again, loaded = _round(client, loaded, horizon + 5)
    assert again == sorted(claimed[:2])
    third, _ = _round(client, loaded, horizon + 10)
    assert third == []


def test_a_parked_task_is_not_read_until_woken(client: Client) -> None:
    ids = _enqueue(client, 3)
    with client.store.engine.begin() as conn:
        conn.execute(text("UPDATE ax_task SET status = 'READY', parked = true "
                          "WHERE task_id = :t"), {"t": ids[0]})
    horizon = client.store.now_ms() + 10_000
    got, loaded = _round(client, Loaded(), horizon)
    assert got == ids[1:]
    with client.store.engine.begin() as conn:
        conn.execute(text("UPDATE ax_task SET parked = false WHERE task_id = :t"),
                     {"t": ids[0]})
    woken, _ = _round(client, loaded, horizon)
    assert woken == ids[:1]


def test_an_instant_larger_than_the_limit_is_read_whole_and_passed(client: Client) -> None:
    at = client.store.now_ms() + 3000
    run_at = datetime.fromtimestamp(at / 1000, UTC)
    ids = sorted(int(i) for i in client.enqueue_many(
        [{"task_type": "t", "payload": {"i": i}, "run_at": run_at} for i in range(25)]))
    later = _enqueue(client, 5, delay=6, tag="later")
    horizon = at + 10_000
    got, loaded = _round(client, Loaded(), horizon, limit=10)
    assert got == ids and loaded.until == at + 1
    rest, loaded = _round(client, loaded, horizon, limit=10)
    assert rest == later and loaded.until == horizon


def test_the_shares_split_the_ids_and_cover_them(client: Client) -> None:
    ids = _enqueue(client, 60)
    horizon = client.store.now_ms() + 10_000
    shares = [_round(client, Loaded(), horizon, share=Share(3, k))[0] for k in range(3)]
    assert sorted(t for part in shares for t in part) == ids
    assert all(10 <= len(part) <= 30 for part in shares), [len(p) for p in shares]
    assert Share.among(["b", "a", "c"], "b") == Share(3, 1)
    assert Share.among(["a"], "z") == Share(2, 1)  # it counts itself
    with client.store.engine.begin() as conn:
        strays = preload.overdue_elsewhere(conn, horizon, Share(3, 0), 1000)
        assert sorted(t for t, _ in strays) == sorted(shares[1] + shares[2])
        assert preload.overdue_elsewhere(conn, horizon, preload.ALL, 1000) == []


@pytest.mark.integration
def test_a_writer_that_commits_after_the_round_is_read_by_the_next(pg_url: str) -> None:
    """A producer's transaction has its id before the round's snapshot, a younger one has
    committed, and it commits after the round: its rows are due inside the window the
    round has read, so only the snapshot's in-progress list finds them (the band has moved
    past, and its id is below the snapshot's xmax)."""
    from ax_kombu.config import from_env

    cfg = from_env({}, database_url=pg_url)
    client = Client(cfg)
    try:
        _enqueue(client, 1)
        horizon = client.store.now_ms() + 10_000
        with client.store.engine.connect() as slow:
            tx = slow.begin()
            writer = int(slow.execute(text("SELECT pg_current_xact_id()::text")).scalar())
            _enqueue(client, 1, tag="younger")  # commits: the writer is now below xmax
            _, loaded = _round(client, Loaded(), horizon)
            mark = loaded.mark
            assert mark is not None and writer < mark.xmax and writer in mark.xip
            late = _enqueue(client, 2, tag="late")  # after the snapshot
            slow.execute(text(
                "UPDATE ax_task SET status = 'READY' WHERE task_id = :t"), {"t": late[0]})
            got, loaded = _round(client, loaded, horizon)
            assert got == late  # the committed one, and the other by its new id
            with client.store.engine.begin() as conn:  # a claim moves late[1] on meanwhile
                assert len(claim(conn, late[1:], "s1", horizon, due_before=horizon)) == 1
            slow.execute(text(
                "UPDATE ax_task SET trigger_time = trigger_time + 1 WHERE task_id = :t"),
                {"t": late[0]})
            _, loaded = _round(client, loaded, horizon)
            tx.commit()
        got, _ = _round(client, loaded, horizon)
        assert got == late[:1]  # armed by the writer that committed late
    finally:
        client.close()


def test_a_created_row_from_an_older_producer_is_read_and_claimed(client: Client) -> None:
    """Producers before migration 0011 insert CREATED rows: read like DELAYED ones (the
    database stamps them on insert whoever writes), and claimed."""
    (task_id,) = _enqueue(client, 1)
    horizon = client.store.now_ms() + 10_000
    _, loaded = _round(client, Loaded(), horizon)
    with client.store.engine.begin() as conn:  # as an older producer writes it
        row = conn.execute(text("SELECT * FROM ax_task WHERE task_id = :t"),
                           {"t": task_id}).mappings().one()
        conn.execute(text("DELETE FROM ax_task WHERE task_id = :t"), {"t": task_id})
        names = list(row)
        conn.execute(text(f"INSERT INTO ax_task ({', '.join(names)}) VALUES "
                          f"({', '.join(':' + k for k in names)})"),
                     {**{k: row[k] for k in names}, "status": "CREATED"})
    got, _ = _round(client, loaded, horizon)
    assert got == [task_id]
    with client.store.engine.begin() as conn:
        (claimed,) = claim(conn, [task_id], "s1", horizon, due_before=horizon)
    assert claimed.attempt == 1 and client.get(task_id).status.value == "DISPATCHING"
