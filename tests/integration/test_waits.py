"""Waits woken by the store's ``NOTIFY ax_ended`` (:mod:`ax_kombu.store.waits`, issue 39
"Waits that listen"): ``Client.wait`` and the async listener return within 50 ms of the
commit that ended their task, each waiter only for its own task, across a killed listener
connection; every store move to a final status announces its ids; SQLite still polls."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.celery import handoff
from ax_kombu.celery.ends import End
from ax_kombu.celery.fence import Fence
from ax_kombu.config import from_env
from ax_kombu.core.states import Status
from ax_kombu.exceptions import AxError, WaitTimeout
from ax_kombu.store import gates, recovery, transitions
from ax_kombu.store.transitions import Finish, Started
from ax_kombu.store.waits import ENDED_CHANNEL, IDS_PER_NOTIFY, AsyncEndListener, payloads

from ..waiting import eventually

NODE = "worker@waits-test"
#: Done-when: a wait returns within this of the commit that ended its task
BOUND_S = 0.05
#: a wait this old would poll every 0.5 s (the SQLite back-off): the end comes after it
OLD_WAIT_S = 1.2


class Counting(Client):
    """A client that counts its reads of each task row."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.reads: dict[int, int] = {}

    def get(self, task_id: int) -> Any:
        self.reads[task_id] = self.reads.get(task_id, 0) + 1
        return super().get(task_id)


@pytest.fixture
def client(pg_url: str) -> Iterator[Counting]:
    c = Counting(from_env({}, database_url=pg_url))
    yield c
    c.close()


def running(client: Client, count: int, attempt: int = 1) -> list[int]:
    """``count`` tasks RUNNING at ``attempt`` on NODE, as a worker's start leaves them."""
    ids = [int(client.enqueue("waits.t", {"i": i})) for i in range(count)]
    with client.store.engine.begin() as conn:
        conn.execute(text("UPDATE ax_task SET status = 'RUNNING', attempt = :att, "
                          "owner_node = :node, dispatched_at = 0 WHERE task_id = ANY(:ids)"),
                     {"node": NODE, "ids": ids, "att": attempt})
    return ids


def finish(client: Client, task_id: int, status: Status = Status.SUCCESS) -> float:
    """End ``task_id`` with ``finish_many`` in a transaction; the monotonic time of its commit."""
    now = client.store.now_ms()
    with client.store.engine.begin() as conn:
        assert transitions.finish_many(conn, [Finish(task_id, 1, status, now)]) == [task_id]
    return time.monotonic()


def cancel(client: Client, task_id: int) -> float:
    client.cancel(task_id)
    return time.monotonic()


class Waiter(threading.Thread):
    """``client.wait(task_id)`` in a thread; ``woke``: the monotonic time it returned."""

    def __init__(self, client: Client, task_id: int, timeout: float = 10.0) -> None:
        super().__init__(daemon=True)
        self.client, self.task_id, self.timeout = client, task_id, timeout
        self.woke: float | None = None
        self.status: str | None = None
        self.error: AxError | None = None
        self.start()

    def run(self) -> None:
        try:
            self.status = self.client.wait(self.task_id, self.timeout).status
        except AxError as exc:  # reported by the test
            self.error = exc
        self.woke = time.monotonic()


pytestmark = pytest.mark.integration


@pytest.mark.parametrize("end", [finish, cancel], ids=["finish_many", "cancel"])
def test_a_wait_returns_within_50_ms_of_the_end(
        client: Counting, end: Callable[[Client, int], float]) -> None:
    [task_id] = running(client, 1)
    waiter = Waiter(client, task_id)
    time.sleep(OLD_WAIT_S)  # the point: polling would by now read every 0.5 s or more
    assert waiter.woke is None
    committed = end(client, task_id)
    waiter.join(5)
    assert waiter.error is None and waiter.woke is not None
    assert waiter.status in ("SUCCESS", "CANCELLED")
    assert waiter.woke - committed < BOUND_S, f"woke {waiter.woke - committed:.3f} s late"


def test_each_waiter_is_woken_by_its_own_end_only(client: Counting) -> None:
    ids = running(client, 12)
    waiters = {i: Waiter(client, i) for i in ids}
    eventually(lambda: all(client.reads.get(i) for i in ids), 5, "every waiter reading")
    for task_id in ids:
        committed = finish(client, task_id)
        waiters[task_id].join(5)
        assert waiters[task_id].woke is not None
        assert waiters[task_id].woke - committed < BOUND_S
        assert all(w.woke is None for i, w in waiters.items() if i > task_id)
    # each read its row at most: first, after the listener connected, after its own end,
    # and at its safety polls; woken by every end it would have read it about 12 times
    assert max(client.reads[i] for i in ids) <= 6, client.reads


def test_a_wait_survives_a_killed_listener_connection(client: Counting) -> None:
    first, second = running(client, 2)
    waiter = Waiter(client, first)
    listener = eventually(lambda: client._listener, 5, "the first wait's listener")[1]
    old = eventually(lambda: listener.backend_pid, 5, "the listener connected")
    with client.store.engine.begin() as conn:
        assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": old}).scalar()
    finish(client, first)  # possibly while no listener is connected: the safety poll sees it
    waiter.join(5)
    assert waiter.status == "SUCCESS"
    eventually(lambda: listener.backend_pid not in (None, old), 5, "the listener reconnected")
    waiter = Waiter(client, second)
    eventually(lambda: client.reads.get(second), 5, "the second wait reading")
    committed = finish(client, second)
    waiter.join(5)
    assert waiter.woke is not None and waiter.woke - committed < BOUND_S


def test_a_wait_times_out_on_a_task_that_does_not_end(client: Counting) -> None:
    [task_id] = running(client, 1)
    started = time.monotonic()
    with pytest.raises(WaitTimeout):
        client.wait(task_id, 0.3)
    assert 0.3 <= time.monotonic() - started < 1.0


def test_the_async_listener_wakes_within_50_ms(client: Counting, pg_url: str) -> None:
    [task_id] = running(client, 1)

    async def main() -> float:
        listener = AsyncEndListener(pg_url)
        try:
            async with listener.watch(task_id) as w:
                assert await w.wait(5.0), "no wake-up once the listener connected"
                assert client.get(task_id).status == "RUNNING"  # the re-read it asks for
                ender = asyncio.get_running_loop().run_in_executor(
                    None, _finish_later, client, task_id)
                assert await w.wait(5.0), "the end woke nothing"
                woke = time.monotonic()
                assert client.get(task_id).status == "SUCCESS"
                return woke - await ender
        finally:
            await listener.aclose()

    assert asyncio.run(main()) < BOUND_S


def _finish_later(client: Client, task_id: int) -> float:
    time.sleep(OLD_WAIT_S)  # the point: an end long after the wait began
    return finish(client, task_id)


def test_the_async_listener_reconnects_after_its_connection_is_killed(
        client: Counting, pg_url: str) -> None:
    async def main() -> None:
        listener = AsyncEndListener(pg_url)
        try:
            async with listener.watch(1) as w:
                assert await w.wait(5.0), "no wake-up once the listener connected"
                old = listener.backend_pid
                with client.store.engine.begin() as conn:
                    conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": old})
                assert await w.wait(5.0), "no wake-up after the reconnection"
                assert listener.backend_pid not in (None, old)
        finally:
            await listener.aclose()

    asyncio.run(main())


def test_the_async_listener_times_out(client: Counting, pg_url: str) -> None:
    async def main() -> bool:
        listener = AsyncEndListener(pg_url)
        try:
            async with listener.watch(1) as w:
                await w.wait(3.0)  # the connection's wake-up
                return await w.wait(0.2)
        finally:
            await listener.aclose()

    assert asyncio.run(main()) is False


def test_sqlite_still_polls(sqlite_url: str) -> None:
    c = Client(from_env({}, database_url=sqlite_url))
    try:
        task_id = int(c.enqueue("waits.t", {}))
        threading.Timer(0.2, c.cancel, (task_id,)).start()
        assert c.wait(task_id, 5).status == "CANCELLED"
        assert c._listener is None
    finally:
        c.close()


# -- every path to a final status announces its ids ------------------------------------------

@pytest.fixture
def heard(pg_url: str) -> Iterator[Callable[..., list[int]]]:
    """A plain psycopg connection LISTENing on ``ax_ended``; ``heard(n)`` returns the ids
    announced since the last call, waiting up to 5 s for ``n`` (and 0.1 s for any more)."""
    conn = psycopg.connect(pg_url, autocommit=True)
    conn.execute(f"LISTEN {ENDED_CHANNEL}")

    def ids(count: int = 1) -> list[int]:
        got: list[int] = []
        for timeout in (5.0, 0.1):
            for note in conn.notifies(timeout=timeout):
                got += [int(i) for i in note.payload.split(",")]
                if len(got) >= count:
                    break
        return got
    yield ids
    conn.close()


def test_cancel_and_cancel_many_announce(client: Counting,
                                         heard: Callable[..., list[int]]) -> None:
    one, two, three = (int(client.enqueue("waits.t", {"i": i})) for i in range(3))
    client.cancel(one)
    assert heard() == [one]
    assert client.cancel_many(task_type="waits.t") == 2
    assert sorted(heard(2)) == [two, three]


def test_finish_many_announces_final_ends_not_retries(
        client: Counting, heard: Callable[..., list[int]]) -> None:
    ok, failed, retried = running(client, 3)
    now = client.store.now_ms()
    with client.store.engine.begin() as conn:
        transitions.finish_many(conn, [Finish(ok, 1, Status.SUCCESS, now),
                                       Finish(failed, 1, Status.FAILED, now, "boom"),
                                       Finish(retried, 1, Status.DELAYED, now + 60_000, "x")])
    assert sorted(heard(2)) == sorted([ok, failed])


def test_a_large_batch_is_announced_in_several_notifications(
        client: Counting, heard: Callable[..., list[int]]) -> None:
    ids = [int(t) for t in client.enqueue_many(
        [{"task_type": "waits.t", "payload": {"i": i}} for i in range(2 * IDS_PER_NOTIFY + 9)])]
    with client.store.engine.begin() as conn:
        conn.execute(text("UPDATE ax_task SET status = 'RUNNING', attempt = 1"))
        now = client.store.now_ms()
        transitions.finish_many(conn, [Finish(i, 1, Status.SUCCESS, now) for i in ids])
    assert sorted(heard(len(ids))) == sorted(ids)
    assert len(payloads(ids)) == 3 and all(len(p) < 8000 for p in payloads(ids))


def test_celery_ends_and_cancels_announce(client: Counting, pg_url: str,
                                          heard: Callable[..., list[int]]) -> None:
    ended, revoked = running(client, 2)
    fence = Fence(from_env({}, database_url=pg_url), NODE)
    task = Started(ended, "waits.t", 0, "default", 0, 0, 1000, "waits.t", None, "{}", "trace")
    now = client.store.now_ms()
    assert fence.record([End(task, Finish(ended, 1, Status.SUCCESS, now), "RETRY", now)])
    assert heard() == [ended]
    assert fence.cancel(revoked, 1, "revoked")
    assert heard() == [revoked]


def test_recovery_giving_up_announces(client: Counting,
                                      heard: Callable[..., list[int]]) -> None:
    lost, unacked = running(client, 2)
    now = client.store.now_ms()
    with client.store.engine.begin() as conn:
        conn.execute(text("UPDATE ax_task SET max_retry = 0, retry_count = 0"))
        conn.execute(text("UPDATE ax_task SET status = 'DISPATCHING', redispatches = 4 "
                          "WHERE task_id = :id"), {"id": unacked})
        assert recovery.recover_running(conn, [NODE], now) == [(lost, "FAILED")]
        assert recovery.redispatch_unacked(conn, now, 1, ["default"], 5) == [
            (unacked, "FAILED")]
    assert sorted(heard(2)) == sorted([lost, unacked])


def test_an_unbuildable_message_announces(client: Counting,
                                          heard: Callable[..., list[int]]) -> None:
    [task_id] = running(client, 1)
    with client.store.engine.begin() as conn:
        conn.execute(text("UPDATE ax_task SET status = 'DISPATCHING'"))
        assert gates.fail_unbuildable(conn, [gates.Unbuildable(task_id, 1, "bad")], NODE,
                                      client.store.now_ms()) == [task_id]
    assert heard() == [task_id]


def test_a_celery_hand_off_is_not_announced(client: Counting,
                                            heard: Callable[..., list[int]]) -> None:
    """The hand-off is the scheduler's publish: it sends no notification (its commit would
    queue behind every notifying transaction); a waiter finds it at its next re-read."""
    [task_id] = running(client, 1)
    with client.store.engine.begin() as conn:
        conn.execute(text("UPDATE ax_task SET status = 'DISPATCHING'"))
        assert handoff.record(conn, [handoff.Handed(task_id, 1, '{"celery_task_id": "x"}')],
                              client.store.now_ms()) == [task_id]
    assert heard() == []
