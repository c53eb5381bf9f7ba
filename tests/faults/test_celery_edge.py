"""A Celery-bound task whose message cannot be built, due with ordinary tasks (issue 22,
item 2), in real processes: one ``ax-scheduler`` and one ``ax-worker`` on PostgreSQL + Redis.

Before: the publisher raised on the bad message, the whole publish batch went back to READY
(no re-dispatch counted) and was claimed again every second for ever: the ordinary tasks
of that batch never ran, the bad one never ended. Now the bad one ends FAILED with the
reason, and the others run, each once (counted from the ledger ``fault.task`` writes).
"""

from __future__ import annotations

import pytest
from sqlalchemy import text

from ..waiting import wait_until
from .cluster import Cluster

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.integration]

#: ordinary tasks due with the bad one (one claim batch takes them all)
ORDINARY = 20


def _make_unbuildable(cluster: Cluster, task_id: int) -> None:
    """Turn a stored task into a Celery-bound one whose payload is not the object the Celery
    wire needs: as a row written before migration 0009 (which backfills ``runner`` from the
    ``celery:`` prefix) or by hand. ``ax.enqueue`` refuses to write one."""
    columns = {r[0] for r in cluster.query(
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'ax_task'")}
    runner = ", runner = 'celery'" if "runner" in columns else ""
    with cluster.reader.begin() as conn:
        conn.execute(text(f"UPDATE ax_task SET processor_name = 'celery:cleanup'{runner}, "
                          "payload = '\"not an object\"' WHERE task_id = :id"), {"id": task_id})


def test_an_unbuildable_message_fails_its_task_alone(cluster: Cluster) -> None:
    ids = cluster.enqueue_many([{"task_type": "fault.task", "payload": {"i": i}, "delay": 0.5}
                                for i in range(ORDINARY + 1)])
    bad, ordinary = ids[0], ids[1:]
    _make_unbuildable(cluster, bad)
    cluster.worker("w0")
    cluster.scheduler("s0")
    cluster.wait_registered(["s0", "w0"], timeout=20)

    ran = wait_until(lambda: set(cluster.ledger.by_task()) >= set(ordinary), 15)
    assert ran, f"ordinary tasks never ran: {cluster.status_of(ordinary)}\n{cluster.tails()}"
    failed = wait_until(lambda: cluster.task_rows([bad])[bad].status == "FAILED", 5)
    row = cluster.task_rows([bad])[bad]
    assert failed, f"the bad task is {row.status}\n{cluster.tails()}"
    assert "cannot build the Celery message" in row.last_error
    assert "payload must be an object" in row.last_error
    assert wait_until(lambda: cluster.status_of(ordinary) == {"SUCCESS": ORDINARY}, 5), \
        cluster.status_of(ordinary)
    runs = cluster.ledger.by_task()
    assert {i: len(runs[i]) for i in ordinary} == dict.fromkeys(ordinary, 1)  # once each
    assert bad not in runs
