"""Races between real processes on both stores: dedup, biz_key, claims, ids."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import func, select

from ax_kombu.api import Client
from ax_kombu.config import Settings
from ax_kombu.core.states import Status
from ax_kombu.store import transitions
from ax_kombu.store.schema import tasks

from .. import procs

pytestmark = pytest.mark.timeout(180)


def race(target: Callable[..., None], n: int, *args: Any) -> list[Any]:
    """Run ``target`` in ``n`` processes of their own released together; collect what each
    puts."""
    ctx = procs.context()
    barrier, out = ctx.Barrier(n), ctx.Queue()
    workers = [ctx.Process(target=target, args=(*args, barrier, out) if not _indexed(target)
                           else (*args, barrier, out, i)) for i in range(n)]
    for w in workers:
        w.start()
    results = [out.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    return results


def _indexed(target: Callable[..., None]) -> bool:
    return target is procs.enqueue_biz


def count_rows(settings: Settings) -> int:
    client = Client(settings)
    with client.store.engine.connect() as conn:
        n = int(conn.execute(select(func.count()).select_from(tasks)).scalar_one())
    client.close()
    return n


def test_eight_processes_enqueue_the_same_task_once(settings: Settings) -> None:
    Client(settings).close()  # schema in place before the race
    results = race(procs.enqueue_same, 8, settings.database_url)
    assert len({task_id for task_id, _ in results}) == 1
    assert sorted(created for _, created in results) == [False] * 7 + [True]
    assert count_rows(settings) == 1


def test_eight_processes_same_biz_key_once(settings: Settings) -> None:
    Client(settings).close()
    results = race(procs.enqueue_biz, 8, settings.database_url)
    assert len({task_id for task_id, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    assert count_rows(settings) == 1


def test_racing_claimers_claim_every_task_exactly_once(settings: Settings) -> None:
    client = Client(settings)
    ids = [int(t) for t in client.enqueue_many(
        [{"task_type": "race", "payload": {"i": i}} for i in range(1000)])]
    with client.store.engine.begin() as conn:
        transitions.transition(conn, ids, [Status.CREATED], Status.READY)
    results = race(procs.claim_all, 4, settings.database_url, ids, "node")  # node + shuffle seed
    won = [task_id for _, claimed in results for task_id in claimed]
    assert sorted(won) == sorted(ids)  # every task once, none twice
    with client.store.engine.connect() as conn:
        statuses = conn.execute(select(tasks.c.status, tasks.c.attempt, func.count())
                                .group_by(tasks.c.status, tasks.c.attempt)).all()
    assert statuses == [("DISPATCHING", 1, 1000)]
    client.close()


def test_ids_from_many_processes_never_collide(settings: Settings) -> None:
    Client(settings).close()
    results = race(procs.make_ids, 6, settings.database_url)
    every = [i for chunk in results for i in chunk]
    assert len(every) == 60_000 and len(set(every)) == 60_000
    for chunk in results:
        assert chunk == sorted(chunk)
