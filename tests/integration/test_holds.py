"""A worker's held runs (:mod:`ax_kombu.worker.holds`) on both stores: a held run is in the
row before anything may rely on it; a release waits until the row no longer holds it; a
write refused (the incarnation is no longer live) releases nothing; runs forgotten while
held leave the row."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import select, update

from ax_kombu.api import Client
from ax_kombu.store import nodes
from ax_kombu.store.schema import nodes as node_table
from ax_kombu.worker.holds import Holds

pytestmark = [pytest.mark.integration]


class Scan:
    """Stands in for the intake's scan: holds what a test puts in ``to_hold``, releases
    early what it puts in ``soon``; ``done`` is set after each scan."""

    def __init__(self) -> None:
        self.holds: Holds | None = None
        self.to_hold: list[int] = []
        self.soon: list[int] = []
        self.done = threading.Event()
        self.incarnation = 0

    def __call__(self) -> list[int]:
        assert self.holds is not None
        if self.to_hold:
            self.holds.hold([(t, self.incarnation) for t in self.to_hold])
            self.to_hold = []
        soon, self.soon = self.soon, []
        self.done.set()
        return soon


@pytest.fixture
def rig(client: Client) -> Iterator[tuple[Holds, nodes.Heartbeat, Scan]]:
    heart = nodes.Heartbeat(client.store, "w0", "worker")
    heart.register({})
    scan = Scan()
    scan.incarnation = heart.incarnation
    holds = scan.holds = Holds(heart, client.store.engine, scan)
    holds.start()
    yield holds, heart, scan
    holds.stop()


def listed(client: Client) -> set[str]:
    with client.store.engine.connect() as conn:
        value = conn.execute(select(node_table.c.listed_runs)
                             .where(node_table.c.node_id == "w0")).scalar()
    return set((value or ",").strip(",").split(",")) - {""}


def written(holds: Holds, ids: set[int], timeout: float = 5.0) -> bool:
    """Until the writer has committed exactly ``ids`` (a poll with a deadline)."""
    deadline = threading.Event()
    timer = threading.Timer(timeout, deadline.set)
    timer.start()
    try:
        while holds.written != frozenset(ids) and not deadline.wait(0.01):
            pass
        return holds.written == frozenset(ids)
    finally:
        timer.cancel()


def test_a_held_run_is_written_then_released_before_it_may_start(
        client: Client, rig: tuple[Holds, nodes.Heartbeat, Scan]) -> None:
    holds, heart, scan = rig
    holds.hold([(99, heart.incarnation - 1)])  # fenced under an earlier incarnation: not written
    scan.to_hold = [11, 12, 13]
    assert written(holds, {11, 12, 13})
    assert listed(client) == {"11", "12", "13"}
    assert holds.release(12, heart.incarnation, lambda: False)
    assert listed(client) == {"11", "13"}  # committed before release() returned
    scan.soon = [11]  # the lane's threads will reach it: released early
    assert written(holds, {13})
    assert listed(client) == {"13"}
    holds.forget([13])  # withdrawn while held: no longer listed
    assert written(holds, set())
    assert listed(client) == set()
    holds.hold([(14, heart.incarnation)])  # a run withdrawn while it waits for its release ends its wait at once
    assert not holds.release(14, heart.incarnation, lambda: True)
    assert holds.release(15, heart.incarnation, lambda: False)  # never held: free at once


def test_nothing_is_released_under_an_incarnation_that_is_no_longer_live(
        client: Client, rig: tuple[Holds, nodes.Heartbeat, Scan]) -> None:
    holds, heart, scan = rig
    scan.to_hold = [21]
    assert written(holds, {21})
    with client.store.engine.begin() as conn:  # declared dead by a peer
        conn.execute(update(node_table).values(stopped_at=1))
    assert not holds.release(21, heart.incarnation, lambda: False)
    assert listed(client) == {"21"}  # the recovery still sees it never started
