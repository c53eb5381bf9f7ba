"""Redis Sentinel under load (issue 24): the primary is SIGKILLed, a replica that fell
behind is promoted, and ax — reaching Redis only through the sentinels, configured as a
user would (``AX_BROKER_URL=sentinel://…;sentinel://…;sentinel://…``,
``AX_BROKER_TRANSPORT_OPTIONS={"master_name": "mymaster"}``) — reconnects by itself and
loses nothing.

The set (:mod:`tests.multihost.sentinel`): a primary, one replica, three sentinels
(quorum 2, down after 1 s), on free loopback ports. The cluster: 2 schedulers and 2
workers (:class:`tests.faults.cluster.Cluster`) on a fresh PostgreSQL database, under a
steady 100 tasks/s.

Replication is asynchronous, so a promoted replica may lack writes. To make that
certain rather than lucky, the replica is made to fall behind first (SIGSTOP, its link
closed on the primary) while two bursts of slow tasks go through the ``slow`` queue,
more than its consumers take at once, so messages wait in Redis:

* burst A is published *before* the cut: the replica keeps its messages, and the ones
  the workers pop from the primary after the cut come back on the promoted replica —
  stale copies of a (task, attempt) already delivered, which must not run again;
* burst B is published *after* the cut: whatever of it still waits in the primary when
  it is killed is gone. Those tasks stay DISPATCHING; once the queue has drained and
  their ack timeout passed, the scheduler's recovery (which asks the broker, through
  the sentinels, whether the queue is empty) dispatches them again at a new attempt.

What the new primary lacks and what it has in excess are read exactly: the primary's
lists just before the kill, and the replica's right after it is continued (before it is
promoted, while nothing consumes from it). Judged (:mod:`tests.faults.judge`): 0 lost,
0 run twice for one attempt, 0 ran twice, 0 early, tasks enqueued after the promotion
run exactly once; lateness during and after the fault is reported.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.cluster import Cluster
from tests.faults.judge import conclude, judge
from tests.faults.producer import Planned, Producer
from tests.faults.test_faults import load_then
from tests.faults.timing import now_ms, poll
from tests.ledger import Run
from tests.services import serving

from .conftest import need_tool
from .sentinel import RedisProcess, SentinelSet

#: the steady load (tasks/s) and how long it runs (s)
LOAD_S = 12.0
#: the steady load has run this long (s) before the fault starts
FAULT_AFTER_S = 3.0
#: slow tasks per burst, and the work of each (s): the slow lanes of both workers
#: (4 threads, a stage of 4 each) take 16 at once, the rest waits in Redis
BURST = 40
BURST_WORK_S = 0.5
#: how long the replica is behind before the primary is killed (s)
BEHIND_S = 1.5
#: at least this many burst A messages wait in the primary when the replica is cut off
WAITING_AT_CUT = 12


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    need_tool("Redis Sentinel", "redis-server")
    where = tmp_path / "redis"
    where.mkdir()
    servers = SentinelSet(where)
    with serving("a Redis Sentinel set", servers.start, servers.stop):
        yield servers


def waiting(server: RedisProcess, queues: list[str]) -> set[tuple[int, int]]:
    """The (task id, attempt) of every message waiting in ``queues`` on ``server``
    (ax's delivery tag is ``task_id.attempt``)."""
    client = server.client(2.0)
    try:
        values = [v for q in queues for v in client.lrange(q, 0, -1)]
    finally:
        client.close()
    pairs = set()
    for value in values:
        task_id, _, attempt = json.loads(value)["properties"]["delivery_tag"].partition(".")
        pairs.add((int(task_id), int(attempt)))
    return pairs


def slow_burst(cluster: Cluster, tag: str, lead: tuple[float, float], seed: int) -> Producer:
    burst = Producer(cluster, lead=lead, options={"priority": "slow"}, tag=tag, seed=seed,
                     work=lambda i: BURST_WORK_S)
    burst.enqueue(BURST)
    return burst


def published(cluster: Cluster, ids: list[int]) -> bool:
    """Every task of ``ids`` was claimed and handed to the broker (or further)."""
    return not {"CREATED", "DELAYED", "READY", "MISSING"} & set(cluster.status_of(ids))


class Failover:
    """The fault, step by step, and what the servers held at each step."""

    def __init__(self, cluster: Cluster, servers: SentinelSet) -> None:
        self.cluster, self.servers = cluster, servers
        self.queues = [cluster.settings.broker_key_prefix + cluster.settings.queue_for(p)
                       for p in ("high", "default", "slow")]
        self.bursts: list[Producer] = []
        self.on_primary: set[tuple[int, int]] = set()
        self.on_replica: set[tuple[int, int]] = set()
        self.times: dict[str, int] = {}

    def __call__(self) -> tuple[int, int]:
        cluster, servers = self.cluster, self.servers
        slow = [self.queues[2]]
        stale = slow_burst(cluster, "burst A (published before the cut)", (0.8, 0.9), 21)
        self.bursts.append(stale)
        cluster.wait_for(lambda: published(cluster, stale.ids)
                         and len(waiting(servers.primary, slow)) >= WAITING_AT_CUT, 15,
                         "burst A published and waiting in the primary")
        self.times["cut"] = now_ms()
        servers.cut_replica()
        lost = slow_burst(cluster, "burst B (published after the cut)", (0.5, 0.6), 22)
        self.bursts.append(lost)
        cluster.wait_for(lambda: published(cluster, lost.ids)
                         and now_ms() >= self.times["cut"] + BEHIND_S * 1000, 15,
                         "burst B published")
        self.on_primary = waiting(servers.primary, self.queues)
        servers.kill_primary()
        self.times["kill"] = now_ms()
        servers.resume_replica()
        link_down = poll(lambda: servers.info(servers.replica).get("master_link_status")
                         == "down", 10, 0.02)
        assert link_down, f"the replica never noticed its primary was gone\n{servers.tails()}"
        self.on_replica = waiting(servers.replica, self.queues)
        promoted = poll(servers.promoted, 30, 0.05)
        assert promoted, f"the sentinels did not promote the replica\n{servers.tails()}"
        self.times["promoted"] = now_ms()
        return self.times["cut"], self.times["promoted"]


def late(planned: list[Planned], by_task: dict[int, list[Run]], lo: int, hi: int) -> int | None:
    values = [by_task[p.task_id][0].start - p.trigger for p in planned
              if lo <= p.trigger <= hi and p.task_id in by_task]
    return max(values) if values else None


@pytest.mark.timeout(115)
def test_primary_killed_lagging_replica_promoted(pg_url: str, sentinels: SentinelSet,
                                                 tmp_path: Path) -> None:
    broker = {"broker_url": sentinels.url,
              "broker_transport_options": json.dumps(sentinels.transport_options)}
    cluster = Cluster(pg_url, broker, tmp_path)
    try:
        cluster.standard()
        fault = Failover(cluster, sentinels)
        load, cut_at, promoted_at = load_then(cluster, LOAD_S, FAULT_AFTER_S, fault)
        bursts = [p for b in fault.bursts for p in b.planned]
        verdict = judge(cluster, "Redis Sentinel: primary SIGKILLed, lagging replica promoted",
                        load.planned + bursts, fault_start=cut_at, fault_end=promoted_at)
        problems = describe(cluster, sentinels, fault, load.planned, bursts, verdict.extra)
        conclude(cluster, verdict)
        assert not problems, "; ".join(problems) + "\n" + cluster.tails(15)
    finally:
        cluster.close()


def describe(cluster: Cluster, servers: SentinelSet, fault: Failover, steady: list[Planned],
             bursts: list[Planned], extra: dict[str, object]) -> list[str]:
    """What the fault did to the messages, into ``extra``; returns what shows the scenario
    did not happen (the replica did not lack anything, nothing came back) or was not
    handled (a lacked message neither ran nor went out again)."""
    by_task = cluster.ledger.by_task()
    lacked = fault.on_primary - fault.on_replica
    came_back = fault.on_replica - fault.on_primary
    fates: Counter[str] = Counter()
    for task_id, attempt in lacked:
        attempts = {r.attempt for r in by_task.get(task_id, [])}
        fates["re-dispatched, ran at a later attempt" if attempts and min(attempts) > attempt
              else "ran at that attempt (popped just before the kill)" if attempt in attempts
              else "did not run"] += 1
    again = sum(1 for task_id, attempt in came_back
                if sum(1 for r in by_task.get(task_id, []) if r.attempt == attempt) > 1)
    times = fault.times
    extra["failover"] = (f"replica cut off {times['kill'] - times['cut']} ms before the kill; "
                         f"promoted {times['promoted'] - times['kill']} ms after it")
    extra["messages waiting in the primary at the kill / in the promoted replica"] = (
        f"{len(fault.on_primary)} / {len(fault.on_replica)}")
    extra["lacked by the new primary: their fate"] = f"{len(lacked)}: {dict(fates)}"
    extra["back on the new primary though delivered (stale copies) / run again"] = (
        f"{len(came_back)} / {again}")
    after = [r.start for runs in by_task.values() for r in runs if r.start > times["promoted"]]
    extra["first run after the promotion"] = (
        f"{min(after) - times['promoted']} ms" if after else "none")
    extra["steady load only: max lateness during / after (ms)"] = (
        f"{late(steady, by_task, times['cut'], times['promoted'])} / "
        f"{late(steady, by_task, times['promoted'] + 1, 2**62)}")
    extra["bursts only: max lateness (ms)"] = late(bursts, by_task, 0, 2**62)
    pops = servers.info(servers.replica, "commandstats").get("cmdstat_rpop", {}).get("calls", 0)
    extra["clients on the new primary / RPOPs it served (the workers' batched pull)"] = (
        f"{clients(servers.replica)} / {pops}")
    problems = []
    if not lacked:
        problems.append("the promoted replica lacked no waiting message: the scenario did "
                        "not happen")
    if not fates["re-dispatched, ran at a later attempt"]:
        problems.append("no message the new primary lacked was dispatched again")
    if fates["did not run"]:
        problems.append(f"{fates['did not run']} messages the new primary lacked never ran")
    if not pops:
        problems.append("the workers' pull consumer never popped from the new primary")
    if not came_back:
        problems.append("no delivered message came back on the promoted replica: the "
                        "scenario did not happen")
    return problems


def clients(server: RedisProcess) -> int:
    """Connections of clients (not of sentinels or replicas) on ``server`` now."""
    client = server.client()
    try:
        listed = client.client_list()
    finally:
        client.close()
    return sum(1 for c in listed if "S" not in c.get("flags", "")
               and not str(c.get("name", "")).startswith("sentinel"))
