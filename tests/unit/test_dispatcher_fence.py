"""The dispatcher's incarnation fence: a claimed batch is published only while the node's
lease covers the incarnation that claimed it; one claimed by an incarnation declared dead
meanwhile is dropped, and one whose lease stays in doubt past the silence window too; a
publish that fails gives back only the attempts it carried. The real zombie (SIGSTOP/SIGCONT of ax-scheduler) is tests/faults/test_zombies.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from ax_kombu.api import Client
from ax_kombu.config import from_env
from ax_kombu.core.lease import Lease
from ax_kombu.scheduler.dispatcher import Claimed, Dispatcher, to_message
from ax_kombu.store import Store
from ax_kombu.store.claims import claim
from ax_kombu.store.schema import tasks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
          ) -> Iterator[tuple[Dispatcher, Lease, Clock, list[Any]]]:
    cfg = from_env({}, database_url=f"sqlite:///{tmp_path / 'ax.sqlite3'}",
                   broker_url="memory://", heartbeat_interval_s=0.5, heartbeat_misses=3)
    store = Store(cfg)
    clock = Clock()
    lease = Lease(0.2, clock)
    dispatcher = Dispatcher(cfg, store, "sched-unit", lambda ids: None, lease=lease)
    published: list[Any] = []
    monkeypatch.setattr(dispatcher, "_publish", published.extend)
    yield dispatcher, lease, clock, published
    store.close()


def run(dispatcher: Dispatcher, *batches: Claimed) -> None:
    for batch in batches:
        dispatcher.inbox.put(batch)
    dispatcher.inbox.put(None)
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()


def test_a_batch_of_the_live_incarnation_is_published(parts: Any) -> None:
    dispatcher, lease, clock, published = parts
    lease.confirm(clock.now, 7)
    run(dispatcher, Claimed(7, ["a", "b"]))
    assert published == ["a", "b"] and dispatcher.dropped == 0


def test_a_batch_of_an_incarnation_declared_dead_is_dropped(parts: Any) -> None:
    """Claimed before a pause; the beat after it found the node fenced and it registered
    anew (incarnation 8): what incarnation 7 claimed is not published."""
    dispatcher, lease, clock, published = parts
    lease.confirm(clock.now, 7)
    lease.confirm(clock.now, 8)
    run(dispatcher, Claimed(7, ["stale"]), Claimed(8, ["fresh"]))
    assert published == ["fresh"] and dispatcher.dropped == 1


def test_a_lapsed_lease_holds_the_batch_until_the_next_beat_decides(parts: Any) -> None:
    """Resumed after a pause: the lease ran out; the batch waits for the beat, which finds
    the node fenced (a new incarnation): dropped, never published."""
    dispatcher, lease, clock, published = parts
    lease.confirm(clock.now, 7)
    clock.now += 5.0  # paused past the lease
    timer = threading.Timer(0.2, lambda: lease.confirm(clock.now, 9))
    timer.start()
    run(dispatcher, Claimed(7, ["paused"]))
    timer.join()
    assert published == [] and dispatcher.dropped == 1


def test_a_lapsed_lease_confirmed_again_publishes(parts: Any) -> None:
    dispatcher, lease, clock, published = parts
    lease.confirm(clock.now, 7)
    clock.now += 5.0
    timer = threading.Timer(0.2, lambda: lease.confirm(clock.now, 7))
    timer.start()
    run(dispatcher, Claimed(7, ["late but ours"]))
    timer.join()
    assert published == ["late but ours"]


def test_a_failed_publish_gives_back_only_the_attempt_it_carried(tmp_path: Path) -> None:
    """A publish that fails after a pause (a confirm timed out while the node was stopped)
    gives its rows back to READY only at their message's attempt: a row another node
    claimed again meanwhile (a new attempt, DISPATCHING) is left alone."""
    cfg = from_env({}, database_url=f"sqlite:///{tmp_path / 'ax.sqlite3'}",
                   broker_url="memory://")
    client = Client(cfg)
    try:
        lost, ours = (int(client.enqueue("t", {"i": i})) for i in range(2))
        now = client.store.now_ms() + 1000
        with client.store.engine.begin() as conn:
            rows = claim(conn, [lost, ours], "s0", now)
            conn.execute(update(tasks).where(tasks.c.task_id == lost)
                         .values(status="READY"))  # s0 declared dead: its claim went back
            claim(conn, [lost], "s1", now + 1)  # and s1 claimed it again: attempt 2
        returned: list[list[int]] = []
        dispatcher = Dispatcher(cfg, client.store, "s0", returned.append)
        dispatcher._give_back([to_message(r, "s0", now) for r in rows])
        assert returned == [[ours]]
        with client.store.engine.connect() as conn:
            state = {r.task_id: (r.status, r.attempt) for r in conn.execute(
                select(tasks.c.task_id, tasks.c.status, tasks.c.attempt))}
        assert state == {lost: ("DISPATCHING", 2), ours: ("READY", 1)}
    finally:
        client.close()
