"""A worker's start marks (:mod:`ax_kombu.worker.marks`) on both stores: a run may start
only once its mark is committed under its live incarnation; a refused write starts
nothing; forgotten marks leave with the next write; marks asked for later are not
written early."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from sqlalchemy import select, update

from ax_kombu.api import Client
from ax_kombu.store import nodes
from ax_kombu.store.schema import nodes as node_table
from ax_kombu.worker.marks import StartMarks

pytestmark = [pytest.mark.integration]


@pytest.fixture
def marks(client: Client) -> Iterator[tuple[StartMarks, nodes.Heartbeat]]:
    heart = nodes.Heartbeat(client.store, "w0", "worker")
    heart.register({})
    marks = StartMarks(heart, client.store.engine)
    marks.start()
    yield marks, heart
    marks.stop()


def stored(client: Client) -> str | None:
    with client.store.engine.connect() as conn:
        return conn.execute(select(node_table.c.start_marks)
                            .where(node_table.c.node_id == "w0")).scalar()


def test_a_run_is_marked_durably_before_ensure_returns(
        client: Client, marks: tuple[StartMarks, nodes.Heartbeat]) -> None:
    writer, heart = marks
    assert writer.ensure(11, heart.incarnation, lambda: False)
    assert stored(client) == ",11,"
    writer.ask([12, 13])
    assert writer.ensure(13, heart.incarnation, lambda: False)
    assert set(stored(client).strip(",").split(",")) == {"11", "12", "13"}  # type: ignore[union-attr]
    writer.forget(11)
    writer.forget(12)
    assert writer.ensure(14, heart.incarnation, lambda: False)
    assert set(stored(client).strip(",").split(",")) == {"13", "14"}  # type: ignore[union-attr]


def test_nothing_starts_under_an_incarnation_that_is_no_longer_live(
        client: Client, marks: tuple[StartMarks, nodes.Heartbeat]) -> None:
    writer, heart = marks
    with client.store.engine.begin() as conn:  # declared dead by a peer
        conn.execute(update(node_table).values(stopped_at=1))
    assert not writer.ensure(21, heart.incarnation, lambda: False)
    assert ",21," not in (stored(client) or "")
    # a run that is withdrawn while it waits ends its wait at once
    with client.store.engine.begin() as conn:
        conn.execute(update(node_table).values(stopped_at=None))
    assert not writer.ensure(22, heart.incarnation - 1, lambda: True)


def test_a_mark_asked_for_later_is_not_written_before_its_moment(
        client: Client, marks: tuple[StartMarks, nodes.Heartbeat]) -> None:
    writer, heart = marks
    at = time.monotonic() + 0.6
    writer.ask([31], at)
    assert writer.ensure(32, heart.incarnation, lambda: False)
    assert stored(client) == ",32,"
    deadline = time.monotonic() + 5
    while 31 not in writer.durable and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 31 in writer.durable and time.monotonic() >= at - 0.05  # the grid rounds down
    assert ",31," in (stored(client) or "")
