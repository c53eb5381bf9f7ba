"""A host cut off from the network for 30 s mid-burst, then back (issue 24).

Two hosts in network namespaces on one bridge (:mod:`tests.multihost.netns`): host ``a``
runs scheduler ``sa`` and worker ``wa``, host ``b`` runs ``sb`` and ``wb``; the servers
(a private Redis, a forwarder to the shared PostgreSQL) live on their own host, the root
namespace. Every daemon runs the fault suite's short liveness settings
(:data:`tests.faults.cluster.SHORT`: dead after 3 s of silence).

Under a burst (:data:`BURST` tasks due over 10 s) and a steady trickle, host ``a``'s link
is cut silently (a pulled cable: its processes keep running and see only silence) while
``wa`` is in the middle of runs, for :data:`CUT_S` seconds, then healed. ``b`` must
declare ``sa`` and ``wa`` dead and take their work over; when ``a`` comes back, ``sa``
publishes nothing it lost, ``wa`` starts nothing it lost and its late outcomes are
refused, and both register anew and take work again.

Judged from the ledger and the table (:func:`tests.faults.judge.judge`): none lost, none
run twice for one attempt, none early, tasks enqueued after ``a`` is back run exactly once.
A task ``wa`` started before it was declared dead may run again on ``b`` (at-least-once,
as for a SIGKILL mid-task): those are counted, and each must end with ``b``'s outcome.
Any other task run twice, or any run ``wa``'s process starts between being declared dead
and registering anew, breaks the fence. Lateness during and after the cut is reported.

TCP's retransmission interval is capped at :data:`RTO_MAX_MS` on both ends of the
connections that cross the bridge, so host ``a``'s stalled connections resume within
10 s of the heal (not 20 s to over a minute later, as TCP's own backoff would): the
requests they carried from before the cut still land then, after ``b`` has declared
``a`` dead, which is what the fences must withstand; and the test stays under 2 minutes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.faults.judge import EARLY_TOLERANCE_MS, conclude, judge
from tests.faults.producer import Producer
from tests.faults.test_faults import logged
from tests.faults.test_zombies import logged_runs, refused_messages
from tests.faults.timing import now_ms, poll
from tests.faults.verdict import Verdict
from tests.ledger import Run

from .conftest import need_root, need_tool
from .netns import BridgeForwarder, BridgeRedis, HostCluster, Hosts, remove_stale

#: node name -> host
PLACEMENT = {"sa": "a", "wa": "a", "sb": "b", "wb": "b"}
CUT_HOST = "a"
CUT_S = 30.0
#: tasks due over BURST_SPREAD seconds, the first BURST_LEAD seconds after they are enqueued
BURST, BURST_LEAD, BURST_SPREAD = 3000, 3.0, 10.0
#: the cut comes this long after the burst's first task is due
CUT_INTO_BURST_MS = 3000
#: the steady trickle (tasks/s), before, during and after the cut
TRICKLE = 30
#: the trickle goes on this long after host a is back (the "later" tasks)
AFTER_S = 4.0
#: TCP's retransmission interval is capped at this on both ends of every connection that
#: crosses the bridge (see :mod:`tests.multihost.netns`): host a's stalled connections,
#: and the stale requests they carry, resume within 10 s of the heal, well after the
#: others declared a dead, instead of 20 s to over a minute later
RTO_MAX_MS = 10_000
#: how long after the heal host a may take to register anew: the capped retransmission,
#: a heartbeat interval; without the cap (a kernel before 6.15), TCP's own backoff
BACK_WITHIN_S = {True: 20.0, False: 90.0}


def burst_work(i: int) -> float:
    """Mostly 10–40 ms; every 20th task 0.5 s (so a worker is always mid-task)."""
    return 0.5 if i % 20 == 0 else 0.01 + (i % 4) * 0.01


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    need_root("hosts in network namespaces")
    need_tool("hosts in network namespaces", "ip", "bridge")
    remove_stale()
    topology = Hosts(sorted(set(PLACEMENT.values())), rto_max_ms=RTO_MAX_MS)
    try:
        yield topology
    finally:
        topology.close()
    assert not topology.leftovers(), f"left behind: {topology.leftovers()}"


@pytest.fixture
def cluster(pg_url: str, tmp_path: Path, hosts: Hosts) -> Iterator[HostCluster]:
    """The daemons in their hosts; Redis and the PostgreSQL forwarder at the bridge
    address (the test's own reads and the producers go direct)."""
    socat, _ = need_tool("the PostgreSQL forwarder", "socat", "redis-server")
    redis = BridgeRedis(tmp_path, hosts.bridge_address)
    redis.start()
    pg = urlsplit(pg_url)
    forwarder: BridgeForwarder | None = None
    try:
        forwarder = BridgeForwarder(socat, hosts.bridge_address,
                                    (pg.hostname or "127.0.0.1", pg.port or 5432),
                                    tmp_path / "socat.log", RTO_MAX_MS)
        c = HostCluster(pg_url, {"broker_url": redis.url}, tmp_path, hosts, PLACEMENT,
                        daemon_database_url=forwarder.url(pg_url))
        try:
            yield c
        finally:
            for host in set(PLACEMENT.values()):
                hosts.heal(host)
            c.close()
    finally:
        if forwarder is not None:
            forwarder.close()
        redis.stop()


def open_runs(runs: list[Run], pid: int) -> int:
    return sum(1 for r in runs if r.pid == pid and r.end is None)


def _declared_dead(cluster: HostCluster, names: list[str]) -> dict[str, int] | None:
    """Each node's stopped_at (declared dead, DB clock ms), once all of them are."""
    rows = {n: cluster.node(n) for n in names}
    if all(r is not None and r.stopped_at is not None for r in rows.values()):
        return {n: int(r.stopped_at) for n, r in rows.items()}
    return None


def _registered_anew(cluster: HostCluster, names: list[str], incarnations: dict[str, int]
                     ) -> bool:
    """Each node live again under a new incarnation, in the same process (never
    restarted: the cut is not a kill)."""
    for name in names:
        row = cluster.node(name)
        if (row is None or row.stopped_at is not None or row.incarnation == incarnations[name]
                or row.pid != cluster.daemon(name).proc.pid):
            return False
    return True


@pytest.mark.timeout(200)
def test_cut_a_host_off_for_30s_mid_burst(cluster: HostCluster, hosts: Hosts) -> None:
    """See the module docstring."""
    t_start = time.monotonic()
    for name in ("sa", "sb"):
        cluster.scheduler(name)
    for name in ("wa", "wb"):
        cluster.worker(name)
    names = list(PLACEMENT)
    cluster.wait_registered(names)
    cut_nodes = cluster.on_host(CUT_HOST)
    incarnations = {n: int(cluster.node(n).incarnation) for n in cut_nodes}
    pids = {n: cluster.daemon(n).proc.pid for n in names}

    trickle = Producer(cluster, rate=TRICKLE, duration=CUT_S + 60, lead=(1.0, 3.0),
                       tag="trickle").start()
    burst = Producer(cluster, lead=(BURST_LEAD, BURST_LEAD + BURST_SPREAD), tag="burst",
                     seed=9, work=burst_work)
    try:
        for _ in range(BURST // 500):
            burst.enqueue(500)
        first_due = min(p.trigger for p in burst.planned)
        wa_pid = pids["wa"]
        mid = poll(lambda: now_ms() >= first_due + CUT_INTO_BURST_MS
                   and open_runs(cluster.ledger.runs(), wa_pid) >= 1, 20, 0.02)
        assert mid, f"wa was never mid-run during the burst\n{cluster.tails()}"
        hosts.cut(CUT_HOST)
        cut_at = now_ms()
        try:
            held = _held_at_cut(cluster, cut_at)
            dead_at = cluster.wait_for(lambda: _declared_dead(cluster, cut_nodes), 20,
                                       f"b declared {cut_nodes} dead")
            judged_at = now_ms()
            assert hosts.is_cut(CUT_HOST)
            time.sleep(max(0.0, cut_at / 1000 + CUT_S - time.time()))  # the cut's length
        finally:
            hosts.heal(CUT_HOST)
        heal_at = now_ms()
        assert all(cluster.daemon(n).alive for n in names), (
            f"a daemon exited during the cut\n{cluster.tails()}")
        cluster.wait_for(lambda: _registered_anew(cluster, cut_nodes, incarnations),
                         BACK_WITHIN_S[hosts.rto_capped],
                         f"{cut_nodes} registered anew after the heal")
        back_at = now_ms()
        anew_at = int(cluster.node("wa").started_at)
        time.sleep(AFTER_S)  # the later tasks' window, not a condition
    finally:
        trickle.stop()
    assert not trickle.errors, f"the producer failed: {trickle.errors[:3]}"

    verdict = judge(cluster, f"host cut off {CUT_S:.0f} s mid-burst (netns, silent drop)",
                    burst.planned + trickle.planned, fault_start=cut_at, fault_end=back_at)
    problems = _fences(cluster, verdict, held, dead_at, anew_at, pids)
    verdict.extra["a held at the cut: wa running / wa staged (fenced, not started) / sa "
                  "claimed, unpublished"] = (f"{len(held['running'])} / {len(held['staged'])}"
                                             f" / {len(held['claimed'])}")
    verdict.extra["declared dead / heal / registered anew (ms after the cut)"] = (
        f"{judged_at - cut_at} / {heal_at - cut_at} / {back_at - cut_at}")
    verdict.extra["TCP retransmission interval capped on both ends"] = (
        f"{RTO_MAX_MS} ms" if hosts.rto_capped else "no (the kernel's backoff)")
    verdict.extra["messages wa refused, not run (stale, or wa's incarnation dead)"] = len(
        refused_messages(cluster, ["wa"]))
    verdict.extra["zombie fences"] = problems or "held"
    verdict.extra["test wall time so far"] = f"{time.monotonic() - t_start:.1f} s"
    conclude(cluster, verdict)
    assert not problems, problems


def _held_at_cut(cluster: HostCluster, cut_at: int) -> dict[str, dict[int, int]]:
    """What host a held in the table just after the cut (task id -> attempt): nothing of
    a's reaches the database any more, so this is exact once what was on the wire at the
    cut has landed. ``running``: the runs of wa's process open in the ledger; ``staged``:
    RUNNING on wa, due after the cut, not started yet (wa may still start them while its
    lease lasts); ``claimed``: DISPATCHING by sa."""
    time.sleep(0.3)  # a statement a's daemons sent just before the cut has committed
    pid = cluster.daemon("wa").proc.pid
    fenced = {r.task_id: r.attempt for r in cluster.query(
        "SELECT task_id, attempt FROM ax_task WHERE status = 'RUNNING' AND owner_node = 'wa' "
        "AND trigger_time > :t", t=cut_at)}
    runs = [r for r in cluster.ledger.runs() if r.pid == pid]
    running = {r.task_id: r.attempt for r in runs if r.end is None}
    started = {r.task_id for r in runs}
    staged = {t: a for t, a in fenced.items() if t not in started}
    claimed = {r.task_id: r.attempt for r in cluster.query(
        "SELECT task_id, attempt FROM ax_task WHERE status = 'DISPATCHING' "
        "AND owner_node = 'sa'")}
    return {"running": running, "staged": staged, "claimed": claimed}


def _fences(cluster: HostCluster, verdict: Verdict, held: dict[str, dict[int, int]],
            dead_at: dict[str, int], anew_at: int, pids: dict[str, int]) -> list[str]:
    """Host a's invariants beyond the verdict's. A task wa started before it was declared
    dead and b ran again is at-least-once: it leaves the verdict's "ran twice" (counted
    here) when b's run is at a later attempt and the row's outcome is b's."""
    runs = cluster.ledger.by_task()
    rows = cluster.task_rows()
    wa_pid = pids["wa"]
    problems: list[str] = []
    again, refused_outcomes = [], logged_runs(cluster.daemon("wa").log, "result not recorded")
    for task_id, task_runs in list(verdict.ran_twice.items()):
        first, *rest = task_runs
        row = rows[task_id]
        if (first.pid == wa_pid and first.start < dead_at["wa"]
                and all(r.node != "wa" and r.attempt > first.attempt for r in rest)
                and row.status == "SUCCESS" and row.attempt == rest[-1].attempt
                and row.finished_at >= (rest[-1].end or 0) - EARLY_TOLERANCE_MS):
            again.append((task_id, first))
            verdict.ran_twice.pop(task_id)
            verdict.overlapping.pop(task_id, None)
    zombie_starts = sorted((r.task_id, r.attempt) for task_runs in runs.values()
                           for r in task_runs if r.pid == wa_pid
                           and dead_at["wa"] <= r.start < anew_at)
    if zombie_starts:
        problems.append(f"wa started {len(zombie_starts)} runs after it was declared dead and "
                        f"before it registered anew: {zombie_starts[:5]}")
    staged_started = sorted((t, a) for t, a in held["staged"].items()
                            if any(r.attempt == a and r.pid == wa_pid and r.start >= dead_at["wa"]
                                   for r in runs.get(t, [])))
    if staged_started:
        problems.append(f"wa started {len(staged_started)} staged runs after it was declared "
                        f"dead, at the attempt it had lost: {staged_started[:5]}")
    not_refused = [t for t, first in again
                   if first.end is not None and (t, first.attempt) not in refused_outcomes]
    if not_refused:
        problems.append(f"wa's outcomes of {len(not_refused)} runs b took over were not "
                        f"refused: {not_refused[:5]}")
    lost_claims = {t: a for t, a in held["claimed"].items() if rows[t].attempt > a}
    zombie_publishes = sorted((t, a) for t, a in lost_claims.items()
                              if any(r.attempt == a for r in runs.get(t, [])))
    if zombie_publishes:
        problems.append(f"{len(zombie_publishes)} claims sa lost ran at sa's attempt: "
                        f"{zombie_publishes[:5]}")
    if not any(r.pid == wa_pid and r.start > anew_at for rs in runs.values() for r in rs):
        problems.append("wa ran nothing after it registered anew")
    stale_messages = refused_messages(cluster, ["wa", "wb"])
    verdict.extra["ran again on b after wa had started it (at-least-once) / of them wa's "
                  "outcome refused"] = (f"{len(again)} / "
                                        f"{sum(1 for t, f in again if (t, f.attempt) in refused_outcomes)}")
    verdict.extra["sa's claims lost (re-dispatched by b) / their messages refused by a "
                  "worker / sa's log: claims not published"] = (
        f"{len(lost_claims)} / {len(stale_messages & set(lost_claims.items()))} / "
        f"{sum(logged(cluster.daemon('sa').log, 'not published', 'count'))}")
    verdict.extra["declared-dead lines in sa / wa logs"] = " / ".join(
        str(cluster.daemon(n).tail(100000).count("declared dead")) for n in ("sa", "wa"))
    return problems
