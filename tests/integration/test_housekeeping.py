"""The scheduler's housekeeping on both stores (issue 22, items 3 and 10): a recurring job
row that cannot be planned is marked broken with the reason and skipped (the others are
written; ``ax jobs list`` shows it; ``schedule()`` clears it), and the ``ax_node`` rows
of long-stopped nodes are pruned, by the store function and by a running scheduler.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import delete, insert, select, update

from ax_kombu.api import Client
from ax_kombu.config import Settings
from ax_kombu.core.ids import ReservedIds
from ax_kombu.scheduler.recurrence import Materialiser
from ax_kombu.store import Store, nodes
from ax_kombu.store import jobs as job_store
from ax_kombu.store.leases import StoreReserver
from ax_kombu.store.schema import jobs, tasks
from ax_kombu.store.schema import nodes as node_table

from ..waiting import eventually
from .ax_cli import run_ax

pytestmark = pytest.mark.timeout(60)

DAY_MS = 86_400_000


@pytest.fixture
def client(settings: Settings) -> Iterator[Client]:
    c = Client(settings)
    with c.store.engine.begin() as conn:  # the pg_url fixture empties ax_task, not ax_job
        conn.execute(delete(jobs))
    yield c
    with c.store.engine.begin() as conn:
        conn.execute(delete(jobs))
    c.close()


@pytest.fixture
def materialiser(settings: Settings) -> Iterator[Materialiser]:
    store = Store(settings)
    ids = ReservedIds(StoreReserver(store.engine), f"test:{uuid.uuid4().hex[:8]}",
                    settings.id_reservation_s * 1000, store.now_ms)
    yield Materialiser(settings, store, ids, "s-test")
    ids.release()
    store.close()


def _job(client: Client, name: str) -> Any:
    with client.store.engine.connect() as conn:
        return job_store.get_job(conn, name)


def _corrupt(client: Client, name: str, **values: Any) -> None:
    with client.store.engine.begin() as conn:
        conn.execute(update(jobs).where(jobs.c.name == name).values(**values))


def _occurrences(client: Client, name: str) -> int:
    with client.store.engine.connect() as conn:
        return len(list(conn.execute(select(tasks.c.task_id).where(tasks.c.job == name))))


# -- broken jobs -----------------------------------------------------------------------------


@pytest.mark.parametrize("corruption, why", [
    ({"every_ms": 0}, "every must be between 1 second"),  # raised ZeroDivisionError before
    ({"every_ms": None, "cron": "* * * * * *", "tz": "Mars/Olympus_Mons"}, "unknown time zone"),
    ({"every_ms": None, "cron": "61 * * * *"}, "bad cron expression"),
    ({"misfire": "sometimes"}, "unknown misfire policy"),
])
def test_a_job_that_cannot_be_planned_is_marked_broken_and_the_others_are_written(
        client: Client, materialiser: Materialiser, settings: Settings,
        corruption: dict[str, Any], why: str) -> None:
    client.schedule("hk.bad", "t", every=1)
    client.schedule("hk.good", "t", every=1)
    _corrupt(client, "hk.bad", **corruption)
    anchor = _job(client, "hk.good").anchor_ms

    materialiser.run(anchor + 100)

    bad = _job(client, "hk.bad")
    assert bad.broken is not None and why in bad.broken and "s-test" in bad.broken, bad.broken
    assert _occurrences(client, "hk.good") >= 2
    assert _occurrences(client, "hk.bad") == 0
    with client.store.engine.connect() as conn:  # no longer due: never looked at again
        assert [j.name for j in job_store.due_jobs(conn, anchor + DAY_MS, 10)] == ["hk.good"]
    listed = {j.name: j for j in client.jobs()}
    assert listed["hk.bad"].broken == bad.broken and listed["hk.bad"].next_fire_at is None
    assert listed["hk.good"].broken is None and listed["hk.good"].next_fire_at is not None

    proc = run_ax("--db", settings.database_url, "jobs", "list")
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.splitlines()
    assert any(line.startswith("hk.bad ") and line.endswith("broken") for line in table), table
    assert any(line.startswith("hk.bad is broken: ") and why in line for line in table), table
    proc = run_ax("--db", settings.database_url, "jobs", "list", "--json")
    assert {j["name"]: j.get("broken") for j in json.loads(proc.stdout)} == {
        "hk.bad": bad.broken, "hk.good": None}


def test_schedule_again_clears_the_mark(client: Client, materialiser: Materialiser) -> None:
    client.schedule("hk.zone", "t", cron="* * * * * *")
    _corrupt(client, "hk.zone", tz="Mars/Olympus_Mons")
    anchor = _job(client, "hk.zone").anchor_ms
    materialiser.run(anchor + 100)
    assert _job(client, "hk.zone").broken is not None

    client.schedule("hk.zone", "t", cron="* * * * * *")  # e.g. after fixing the zone
    assert _job(client, "hk.zone").broken is None
    materialiser.run(client.store.now_ms())
    assert _occurrences(client, "hk.zone") >= 1


# -- node rows -------------------------------------------------------------------------------


def _node(conn: Any, name: str, heartbeat_at: int, stopped_at: int | None) -> None:
    conn.execute(insert(node_table).values(
        node_id=name, kind="worker", host="elsewhere", pid=1, incarnation=1,
        started_at=heartbeat_at - 1000, heartbeat_at=heartbeat_at, stopped_at=stopped_at,
        info="{}"))


def _node_names(engine: Any) -> set[str]:
    with engine.connect() as conn:
        return {r[0] for r in conn.execute(select(node_table.c.node_id))}


def test_prune_deletes_only_nodes_stopped_before_the_cutoff(settings: Settings) -> None:
    store = Store(settings)
    try:
        now = store.now_ms()
        with store.engine.begin() as conn:
            conn.execute(delete(node_table))
            _node(conn, "live", now, None)
            _node(conn, "silent-not-yet-declared-dead", now - 3 * DAY_MS, None)
            _node(conn, "stopped-an-hour-ago", now - 3_600_000, now - 3_600_000)
            _node(conn, "stopped-two-days-ago", now - 2 * DAY_MS, now - 2 * DAY_MS)
            _node(conn, "declared-dead-two-days-ago", now - 2 * DAY_MS - 20_000,
                  now - 2 * DAY_MS)
        with store.engine.begin() as conn:
            pruned = nodes.prune_stopped(conn, now - DAY_MS)
        assert sorted(pruned) == ["declared-dead-two-days-ago", "stopped-two-days-ago"]
        assert _node_names(store.engine) == {"live", "silent-not-yet-declared-dead",
                                             "stopped-an-hour-ago"}
        with store.engine.begin() as conn:
            assert nodes.prune_stopped(conn, now - DAY_MS) == []
    finally:
        store.close()


def test_a_running_scheduler_prunes_old_node_rows_and_keeps_recent_ones(
        settings: Settings) -> None:
    from ax_kombu.scheduler.node import Scheduler

    cfg = settings.replace(node_retention_s=3600, heartbeat_interval_s=0.5)
    store = Store(cfg)
    now = store.now_ms()
    with store.engine.begin() as conn:
        conn.execute(delete(node_table))
        _node(conn, "worker@gone.1.abcd", now - 2 * DAY_MS, now - 2 * DAY_MS)
        _node(conn, "worker@recent.2.abcd", now - 60_000, now - 60_000)
    scheduler = Scheduler(cfg, "s-prune")
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    try:
        eventually(lambda: "worker@gone.1.abcd" not in _node_names(store.engine), 20,
                   "the old node row pruned")
        assert {"worker@recent.2.abcd", "s-prune"} <= _node_names(store.engine)
    finally:
        scheduler.request_stop()
        thread.join(30)
        store.close()
    assert not thread.is_alive()


@pytest.mark.parametrize("value", [-1, 1, 59, 400 * 86_400])
def test_node_retention_is_validated(settings: Settings, value: float) -> None:
    from ax_kombu.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError, match="node_retention_s"):
        settings.replace(node_retention_s=value)
    assert settings.replace(node_retention_s=0).node_retention_s == 0


def test_a_schedulers_first_pass_waits_for_jobs_another_is_planning(
        client: Client, materialiser: Materialiser, settings: Settings) -> None:
    """Two schedulers restarted together: while one plans a job (its row locked, its misfire
    being settled), the other's first pass waits for that row instead of skipping it, and
    reads it again after the commit, so it preloads nothing the first is about to cancel.
    Later passes skip a locked job. (PostgreSQL: SQLite has no row locks.)"""
    if client.store.engine.dialect.name != "postgresql":
        pytest.skip("row locks: PostgreSQL only")
    client.schedule("hk.locked", "t", every=1)
    anchor = _job(client, "hk.locked").anchor_ms
    finished = threading.Event()
    result: list[tuple[int, bool]] = []
    with client.store.engine.begin() as other:  # the other scheduler, mid-plan
        other.execute(select(jobs).where(jobs.c.name == "hk.locked").with_for_update())
        waiting = threading.Thread(
            target=lambda: (result.append(materialiser.run(anchor + 100)), finished.set()))
        waiting.start()
        assert not finished.wait(0.5), "the first pass skipped a locked job"
        # the other scheduler moves the job past this one's horizon, then commits
        other.execute(update(jobs).where(jobs.c.name == "hk.locked")
                      .values(next_fire_at=anchor + DAY_MS))
    assert finished.wait(10)
    assert result == [(0, False)] and _occurrences(client, "hk.locked") == 0
    _corrupt(client, "hk.locked", next_fire_at=anchor)
    with client.store.engine.begin() as other:  # a later pass skips the locked job
        other.execute(select(jobs).where(jobs.c.name == "hk.locked").with_for_update())
        assert materialiser.run(anchor + 100) == (0, False)
