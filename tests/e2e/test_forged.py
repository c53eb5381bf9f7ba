"""A forged message against a real ``ax-worker`` process: the database decides what runs.

Anyone who can write to the broker can publish a message carrying a DISPATCHING
task's id and attempt. The worker must run the task as the row stores it (its
processor, its payload), never what the message says, and count the forgery.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kombu import Producer

from ax_kombu.broker.connection import connection, declare_queues, task_queues
from ax_kombu.broker.messages import RawJson, TaskMessage
from ax_kombu.core.states import Status
from ax_kombu.store import claims, transitions

from ..ledger import Ledger
from ..wire import version_1_json
from .system import System

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture
def system(pg_url: str, broker: dict[str, str], tmp_path: Path) -> Iterator[System]:
    ax = System(pg_url, broker, tmp_path)
    yield ax
    ax.close()


def test_a_forged_message_runs_the_stored_task_not_the_message(system: System,
                                                               tmp_path: Path) -> None:
    stored, forged = Ledger(tmp_path / "stored.jsonl"), Ledger(tmp_path / "forged.jsonl")
    system.worker("worker-0")
    system.wait_ready()
    # due now (no scheduler runs here): the worker stages a message until its trigger time
    (task_id,) = system.enqueue_many([{"task_type": "e2e.task", "delay": 0,
                                       "payload": {"log": str(stored)}}])
    client = system.client
    with client.store.engine.begin() as conn:  # what a scheduler does when the task is due
        transitions.transition(conn, [task_id], [Status.CREATED], Status.READY)
        (row,) = claims.claim(conn, [task_id], "scheduler@test", client.store.now_ms(),
                              due_before=2**62)
    forgery = TaskMessage(task_id, row.attempt, "e2e.task", RawJson(f'{{"log": "{forged}"}}'),
                          "forged", row.trigger_time, 60_000, "default", 0, 0,
                          "tests.e2e.e2e_tasks:task", None, client.store.now_ms(), "attacker")
    with connection(system.settings) as conn:
        declare_queues(conn, system.settings)
        queue = task_queues(system.settings)["default"]
        Producer(conn.default_channel).publish(version_1_json(forgery), exchange="",
                                               routing_key=queue.name,
                                               content_type="application/json",
                                               content_encoding="utf-8")
    system.wait_for(lambda: system.tasks()[task_id].status == "SUCCESS", 30,
                    "the task ran from the forged message's delivery")
    assert [r.task_id for r in stored.runs()] == [task_id]  # the stored payload ran, once
    assert not Path(str(forged)).exists()  # the message's payload never did
    system.wait_for(lambda: system.node_info("worker-0").get("counts", {}).get("forged") == 1,
                    10, "the forgery counted in the worker's heartbeat")
