"""Issue 24, PostgreSQL failover: the primary dies under load, the standby is promoted,
and every daemon reconnects to it by itself through a multi-host URL.

The pair (:mod:`tests.multihost.pg_pair`) is a private primary and a ``pg_basebackup``
standby replicating **synchronously**, on free loopback ports. ax's database URL is
libpq's multi-host form, ``postgresql://postgres@127.0.0.1:P1,127.0.0.1:P2/ax?
target_session_attrs=read-write``: the daemons get it as ``AX_DATABASE_URL``, the
producer and the test's reads use it too. ax's migrations run on the primary.

2 schedulers and 2 workers (:class:`tests.faults.cluster.Cluster`) on the shared Redis, a
steady load of 100 tasks/s for 12 s due 1–3 s ahead. About 3 s in, while the standby
streams as the synchronous one, every process of the primary is SIGKILLed at once (the
old primary is never started again), then the standby is promoted with ``pg_ctl
promote``. The fault ends once all four nodes have written a heartbeat on the new
primary under the incarnation they had before.

Judged as the fault suite's database cuts are (:mod:`tests.faults.judge`): every task
whose enqueue returned an id ends SUCCESS, none published twice for one attempt, none
run twice (no ax process dies here), no two runs at once, none early, tasks enqueued
after the fault run exactly once; lateness during and after the fault is reported. An
enqueue that raised during the switch is the producer's to retry, not a lost task; a
task it wrote anyway (the commit reached the standby, the reply never came back) must
still run exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.store.engine import make_engine, migrate
from tests.faults.cluster import Cluster
from tests.faults.judge import conclude, judge
from tests.faults.producer import Producer
from tests.faults.timing import now_ms, poll
from tests.services import serving, unavailable

from .conftest import need_root, need_tool
from .pg_pair import PgPair

RATE = 100
LOAD_S = 12.0
FAULT_AFTER_S = 3.0
NODES = ("s0", "s1", "w0", "w1")


@pytest.fixture
def pg_pair(tmp_path: Path) -> Iterator[PgPair]:
    """A private primary + synchronous standby, always stopped and removed."""
    need_root("a private PostgreSQL pair (its servers run as the postgres user)")
    initdb, _, _, _ = need_tool("a private PostgreSQL pair", "initdb", "pg_ctl",
                                "pg_basebackup", "runuser")
    bindir = Path(initdb).resolve().parent  # /usr/local/bin/initdb may be a link to it
    missing = [p for p in ("pg_ctl", "pg_basebackup") if not (bindir / p).exists()]
    if missing:
        unavailable("a private PostgreSQL pair", f"{missing} not next to {bindir / 'initdb'}")
    pair = PgPair(bindir, tmp_path)
    with serving("a private PostgreSQL primary + standby", pair.start, pair.close):
        yield pair


@pytest.fixture
def failover_cluster(pg_pair: PgPair, redis_broker: dict[str, str],
                     tmp_path: Path) -> Iterator[Cluster]:
    """A cluster (not started) whose every connection goes through the multi-host URL."""
    engine = make_engine(pg_pair.primary.url())
    try:
        migrate(engine)
    finally:
        engine.dispose()
    cluster = Cluster(pg_pair.url, redis_broker, tmp_path)
    yield cluster
    cluster.close()


def incarnations(cluster: Cluster) -> dict[str, int]:
    return {r.node_id: int(r.incarnation) for r in cluster.query(
        "SELECT node_id, incarnation FROM ax_node WHERE stopped_at IS NULL")}


def beaten_since(cluster: Cluster, names: Iterable[str], since_ms: int,
                 incarnation: dict[str, int]) -> bool:
    """Whether each node wrote a heartbeat after ``since_ms`` under the same incarnation
    (False while the store cannot be read)."""
    try:
        rows = {r.node_id: r for r in cluster.query(
            "SELECT node_id, incarnation, heartbeat_at FROM ax_node")}
    except SQLAlchemyError:
        return False
    return all(n in rows and rows[n].heartbeat_at > since_ms
               and int(rows[n].incarnation) == incarnation[n] for n in names)


@pytest.mark.timeout(170)
def test_primary_killed_standby_promoted_under_load(pg_pair: PgPair,
                                                    failover_cluster: Cluster) -> None:
    cluster = failover_cluster
    began = time.monotonic()
    cluster.standard()
    before = incarnations(cluster)
    load = Producer(cluster, rate=RATE, duration=LOAD_S).start()
    try:
        t0 = time.monotonic()
        reached = poll(lambda: time.monotonic() - t0 >= FAULT_AFTER_S
                       and cluster.ledger.lines() >= RATE // 2, FAULT_AFTER_S + 20, 0.1)
        assert reached, f"the load never reached the workers\n{cluster.tails()}"
        assert pg_pair.streaming_sync(), "the standby was not the synchronous one at the kill"
        fault_start = now_ms()
        pg_pair.primary.kill()
        killed = now_ms()
        pg_pair.promote()
        promoted = now_ms()
        back = cluster.wait_for(lambda: beaten_since(cluster, NODES, promoted, before), 30,
                                "every node beating on the promoted standby")
        fault_end = now_ms()
    except BaseException:
        load.stop()
        raise
    load.join()
    assert back
    verdict = judge(cluster, "PostgreSQL failover (primary SIGKILLed, standby promoted)",
                    load.planned, fault_start=fault_start, fault_end=fault_end)

    # an enqueue that raised did not hand out an id; one whose commit reached the standby
    # anyway left a task the producer does not know of, which must still run exactly once
    rows = cluster.task_rows()
    unknown = set(rows) - set(load.ids)
    runs = cluster.ledger.by_task()
    unknown_not_once = {t: (rows[t].status, len(runs.get(t, []))) for t in unknown
                        if rows[t].status != "SUCCESS" or len(runs.get(t, [])) != 1}
    dead = [d.name for d in cluster.daemons if not d.alive]
    verdict.extra.update({
        "SIGKILL -> primary gone -> standby promoted -> all 4 nodes beating there (ms)":
            f"{killed - fault_start} / {promoted - killed} / {fault_end - promoted}",
        "enqueue calls that raised (10 tasks each)": len(load.errors),
        "tasks written though their enqueue raised / not run once": (
            f"{len(unknown)} / {len(unknown_not_once)}"),
        "test wall time (s)": f"{time.monotonic() - began:.1f}",
    })
    if load.errors:
        verdict.notes.append(f"first enqueue error: {load.errors[0][:200]}")
    conclude(cluster, verdict)
    assert not unknown_not_once, f"tasks written by a failed enqueue, not run once: " \
                                 f"{dict(list(unknown_not_once.items())[:5])}"
    assert not dead, f"daemons exited: {dead}\n{cluster.tails()}"
    assert incarnations(cluster) == before, "a node was declared dead and registered anew"
