"""A worker's listed runs (:mod:`ax_kombu.worker.listing`) on both stores: a listed run is
in the row before anything may rely on it; a release waits until the row no longer lists it;
a write refused (the incarnation is no longer live) releases nothing; runs forgotten while
listed leave the row."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import select, update

from ax_kombu.api import Client
from ax_kombu.store import nodes
from ax_kombu.store.schema import nodes as node_table
from ax_kombu.worker.listing import Listing

pytestmark = [pytest.mark.integration]


@pytest.fixture
def rig(client: Client) -> Iterator[tuple[Listing, nodes.Heartbeat]]:
    heart = nodes.Heartbeat(client.store, "w0", "worker")
    heart.register({})
    listing = Listing(heart, client.store.engine)
    listing.start()
    yield listing, heart
    listing.stop()


def listed(client: Client) -> set[str]:
    with client.store.engine.connect() as conn:
        value = conn.execute(select(node_table.c.listed_runs)
                             .where(node_table.c.node_id == "w0")).scalar()
    return set((value or ",").strip(",").split(",")) - {""}


def written(listing: Listing, ids: set[int], timeout: float = 5.0) -> bool:
    """Until the writer has committed exactly ``ids`` (a poll with a deadline)."""
    deadline = threading.Event()
    timer = threading.Timer(timeout, deadline.set)
    timer.start()
    try:
        while listing.written != frozenset(ids) and not deadline.wait(0.01):
            pass
        return listing.written == frozenset(ids)
    finally:
        timer.cancel()


def test_a_listed_run_is_written_then_released_before_it_may_start(
        client: Client, rig: tuple[Listing, nodes.Heartbeat]) -> None:
    listing, heart = rig
    listing.add([(99, heart.incarnation - 1)])  # fenced under an earlier incarnation: not written
    listing.add([(t, heart.incarnation) for t in (11, 12, 13)])  # the scan listed them
    assert written(listing, {11, 12, 13})
    assert listed(client) == {"11", "12", "13"}
    assert listing.release(12, heart.incarnation, lambda: False)
    assert listed(client) == {"11", "13"}  # committed before release() returned
    listing.release_soon([11])  # the lane's threads will reach it: released early
    assert written(listing, {13})
    assert listed(client) == {"13"}
    listing.forget([13])  # withdrawn while listed: no longer listed
    assert written(listing, set())
    assert listed(client) == set()
    listing.add([(14, heart.incarnation)])  # a run withdrawn while it waits for its release ends its wait at once
    assert not listing.release(14, heart.incarnation, lambda: True)
    assert listing.release(15, heart.incarnation, lambda: False)  # never listed: free at once


def test_nothing_is_released_under_an_incarnation_that_is_no_longer_live(
        client: Client, rig: tuple[Listing, nodes.Heartbeat]) -> None:
    listing, heart = rig
    listing.add([(21, heart.incarnation)])
    assert written(listing, {21})
    with client.store.engine.begin() as conn:  # declared dead by a peer
        conn.execute(update(node_table).values(stopped_at=1))
    assert not listing.release(21, heart.incarnation, lambda: False)
    assert listed(client) == {"21"}  # the recovery still sees it never started
