"""The Celery bootstep's end writer (:mod:`ax_kombu.celery.ends`) against a real store: an
end the store refuses for its data is recorded FAILED with the reason, and the ends
written with it are not held back (issue 22, the twin of the ax worker's result writer)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.celery.ends import End, EndWriter
from ax_kombu.celery.fence import Fence
from ax_kombu.config import from_env
from ax_kombu.core.states import Status
from ax_kombu.store.transitions import Finish, Started

pytestmark = pytest.mark.integration

NODE = "celery@ends-test"


@pytest.fixture
def client(pg_url: str) -> Iterator[Client]:
    c = Client(from_env({}, database_url=pg_url))
    yield c
    c.close()


def running(client: Client, count: int) -> list[int]:
    """``count`` tasks RUNNING at attempt 1 on NODE, as the bootstep's start leaves them."""
    ids = [int(client.enqueue("ends.t", {"i": i})) for i in range(count)]
    with client.store.engine.begin() as conn:
        conn.execute(text("UPDATE ax_task SET status = 'RUNNING', attempt = 1, "
                          "owner_node = :node WHERE task_id = ANY(:ids)"),
                     {"node": NODE, "ids": ids})
    return ids


def end(task_id: int, at_ms: int, ended_at: int) -> End:
    task = Started(task_id, "ends.t", 0, "default", 0, 0, 1000, "ends.t", None, "{}", "trace")
    return End(task, Finish(task_id, 1, Status.SUCCESS, at_ms, result='"ok"'), "RETRY",
               ended_at)


def test_an_end_the_store_refuses_fails_alone_and_the_others_are_written(
        client: Client, pg_url: str) -> None:
    ids = running(client, 5)
    now = int(client.store.now_ms())
    bad = ids[2]
    writer = EndWriter(Fence(from_env({}, database_url=pg_url), NODE).record)
    for task_id in ids:  # finished_at out of a bigint's range: a DataError, not an outage
        writer.put(end(task_id, 2**70 if task_id == bad else now, now))
    assert writer.flush(30), "a refused end held its batch"
    rows = {i: client.get(i) for i in ids}
    assert {i: r.status for i, r in rows.items() if i != bad} == {
        i: "SUCCESS" for i in ids if i != bad}
    assert rows[bad].status == "FAILED"
    assert "outcome refused by the store" in (rows[bad].last_error or "")
    assert "the run ended SUCCESS" in (rows[bad].last_error or "")
