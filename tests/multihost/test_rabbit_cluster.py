"""A RabbitMQ cluster loses a node under load (issue 24): three private nodes, ax's queues
declared as quorum queues (``AX_RABBITMQ_QUEUE_TYPE=quorum``), and every daemon given the
three nodes as Kombu's failover list (``AX_BROKER_URL=amqp://…p1/ax;amqp://…p2/ax;…``).

2 schedulers and 2 workers run on a fresh PostgreSQL database under a steady load of
100 tasks/s for 12 s. Before the load (once a few warm-up tasks have run) the test checks
that every queue of the vhost is a quorum queue with a member on each node, that every
daemon is connected to node 1 (the first URL) and that node 1 leads the ``default``
queue. 4 s into the load node 1's process group is SIGKILLed: the daemons must move to nodes 2 and 3 by themselves (the test watches
their sockets), the queues elect leaders there, and the judge
(:mod:`tests.faults.judge`) finds every task SUCCESS, none run twice (no ax process dies
here, so a message RabbitMQ delivers again after the node loss must be refused by ax's
attempt fence), none published twice for one attempt, none early; the worst lateness
during and after the fault is reported, and after it bounded.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ax_kombu.config import worker_queue
from tests.faults.cluster import Cluster
from tests.faults.judge import conclude, judge
from tests.faults.producer import Producer
from tests.faults.timing import now_ms
from tests.services import serving, unavailable

from .rabbit_cluster import ClusterNode, RabbitCluster

pytestmark = [pytest.mark.timeout(115)]

RATE = 100
LOAD_S = 12.0
#: seconds of load before node 1 is killed
FAULT_AFTER_S = 4.0
#: how long the daemons may take to reach a surviving node
MOVE_TIMEOUT_S = 20.0
#: tasks due once every daemon has moved (plus a second) must start within this (ms)
MAX_LATE_AFTER_MS = 2000
PRIORITY_QUEUES = ("high", "default", "slow")
DAEMONS = ("s0", "s1", "w0", "w1")


@pytest.fixture
def rabbit(tmp_path: Path) -> Iterator[RabbitCluster]:
    try:
        cluster = RabbitCluster(tmp_path / "rabbit")
    except RuntimeError as exc:
        unavailable("a private RabbitMQ cluster", exc)
    with serving("a private RabbitMQ cluster", cluster.start, cluster.stop):
        yield cluster


def test_a_quorum_cluster_loses_the_node_everyone_uses(pg_url: str, rabbit: RabbitCluster,
                                                        tmp_path: Path) -> None:
    first, *survivors = rabbit.nodes
    (tmp_path / "ax").mkdir()
    cluster = Cluster(pg_url, {"broker_url": rabbit.url}, tmp_path / "ax",
                      env={"rabbitmq_queue_type": "quorum"})
    try:
        cluster.standard()
        _warm_up(cluster)
        _check_quorum_queues(survivors[0], rabbit)
        leader = _leader(survivors[0], rabbit.vhost, "default")
        assert leader == first.node, f"node 1 does not lead 'default' ({leader})"
        _wait_connected(cluster, rabbit, {first.port}, DAEMONS, MOVE_TIMEOUT_S)
        load = Producer(cluster, rate=RATE, duration=LOAD_S).start()
        try:
            time.sleep(FAULT_AFTER_S)  # the load runs on: the fault comes in its middle
            fault_start = now_ms()
            first.kill()
            _wait_connected(cluster, rabbit, {n.port for n in survivors}, DAEMONS,
                            MOVE_TIMEOUT_S)
            moved = now_ms()
            fault_end = moved + 1000
        except BaseException:
            load.stop()
            raise
        load.join()
        assert not load.errors, f"the producer failed: {load.errors[:3]}"
        verdict = judge(cluster, "RabbitMQ cluster: SIGKILL the node of every daemon "
                        "(quorum queues)", load.planned, fault_start=fault_start,
                        fault_end=fault_end)
        leaders = {q: _leader(survivors[0], rabbit.vhost, q) for q in PRIORITY_QUEUES}
        verdict.extra["daemons on a surviving node after (ms)"] = moved - fault_start
        verdict.extra["leaders after the kill"] = leaders
        verdict.extra["deliveries refused by the workers (duplicate / fenced)"] = (
            f"{_logged(cluster, ('w0', 'w1'), 'duplicate delivery dropped')} / "
            f"{_logged(cluster, ('w0', 'w1'), 'message refused, not run')}")
        verdict.extra["publish batches nacked (channel replaced)"] = _logged(
            cluster, ("s0", "s1"), "publishes nacked by the broker")
        assert all(leader in {n.node for n in survivors} for leader in leaders.values()), (
            f"a queue has no leader on a surviving node: {leaders}")
        conclude(cluster, verdict, max_late_after_ms=MAX_LATE_AFTER_MS)
        assert verdict.later, "the load ended before the daemons moved: nothing was judged after"
    finally:
        cluster.close()


def _warm_up(cluster: Cluster, tasks: int = 10) -> None:
    """A few tasks due at once, until each has run: every daemon has connected, declared
    its queues and consumes before the load starts."""
    warm = Producer(cluster, tag="warm-up", lead=(0.0, 0.2))
    warm.enqueue(tasks)
    cluster.wait_for(lambda: sum(1 for r in cluster.ledger.runs() if r.end) >= tasks, 30,
                     f"{tasks} warm-up tasks run")


# -- what the broker says ------------------------------------------------------------------------

def _queues(node: ClusterNode, vhost: str) -> list[dict[str, Any]]:
    out = node.must("list_queues", "-p", vhost, "name", "type", "leader", "members",
                    "--formatter", "json", "--quiet")
    rows: list[dict[str, Any]] = json.loads(out)
    return rows


def _leader(node: ClusterNode, vhost: str, queue: str) -> str:
    return str(next(q["leader"] for q in _queues(node, vhost) if q["name"] == queue))


def _check_quorum_queues(node: ClusterNode, rabbit: RabbitCluster) -> None:
    """Every queue of the vhost (per priority and each worker's own) is a quorum queue
    with a member on every node."""
    queues = {q["name"]: q for q in _queues(node, rabbit.vhost)}
    wanted = {*PRIORITY_QUEUES, worker_queue("w0"), worker_queue("w1")}
    assert wanted <= set(queues), f"queues missing: {sorted(wanted - set(queues))}"
    for name, q in queues.items():
        assert q["type"] == "quorum", f"{name} is a {q['type']} queue"
        assert len(q["members"]) == len(rabbit.nodes), f"{name} has members {q['members']}"


# -- where each daemon is connected --------------------------------------------------------------

def _remote_ports(pid: int) -> set[int]:
    """The loopback ports process ``pid`` has an established TCP connection to (its
    socket inodes matched against ``/proc/net/tcp``)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        table = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return set()
    ports = set()
    for line in table:
        fields = line.split()
        remote, state, inode = fields[2], fields[3], fields[9]
        if state == "01" and inode in inodes:  # ESTABLISHED
            ports.add(int(remote.split(":")[1], 16))
    return ports


def _wait_connected(cluster: Cluster, rabbit: RabbitCluster, ports: set[int],
                    names: tuple[str, ...], timeout: float) -> None:
    """Until each daemon of ``names`` holds a connection to one of ``ports`` and to no
    other node of ``rabbit``."""
    others = {n.port for n in rabbit.nodes} - ports

    def where() -> dict[str, set[int]]:
        return {n: _remote_ports(cluster.daemon(n).proc.pid) & {p.port for p in rabbit.nodes}
                for n in names}
    cluster.wait_for(lambda: all(p & ports and not p & others for p in where().values()),
                     timeout, f"{list(names)} connected to ports {sorted(ports)} only",
                     detail=where)


def _logged(cluster: Cluster, names: tuple[str, ...], text: str) -> int:
    """How many times the logs of ``names`` say ``text``."""
    return sum(cluster.daemon(n).log.read_text(errors="replace").count(text) for n in names)
