"""A dead worker's staged runs move in seconds (issue 40): real processes, a real SIGKILL of
a worker's supervisor and its child while it holds staged runs, and the ledger.

A worker stages up to a second of its lanes' work ahead of its threads, fenced RUNNING
under its incarnation. When the host dies, those runs may start elsewhere only once the
dead incarnation's lease has run out: with the default heartbeats (1 s, dead after 3 s of
silence; judged every half interval) that is seconds, where it was the 15 s silence window
before.
"""

from __future__ import annotations

import os
import signal

import pytest

from ax_kombu.config import from_env

from ..waiting import wait_until
from .cluster import WORKER_POOLS, Cluster
from .judge import conclude, judge
from .producer import Producer
from .timing import now_ms

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.integration]

#: every run the killed worker held starts elsewhere within this of the kill (issue 40)
HANDOVER_MS = 5000
#: the burst: tasks due at one instant, each this long; w0's children have 8 default
#: threads each, w1 has :data:`SURVIVOR_POOLS`: it can take the dead worker's share on top of
#: its own within a second or two, so what is measured is the hand-over, not a queue
BURST, WORK_S = 200, 0.25
SURVIVOR_POOLS = WORKER_POOLS.replace("default=8", "default=32")
#: the settings the code's defaults must carry (the test clusters' shorter ones replaced)
DEFAULTED = ("heartbeat_interval_s", "heartbeat_misses", "recovery_interval_s")


@pytest.mark.timeout(150)
def test_sigkill_a_worker_and_its_supervisor_holding_staged_runs(cluster: Cluster) -> None:
    """w0 runs as a supervisor with two children (``w0.1``, ``w0.2``), w1 as a plain worker;
    a burst is due at once. While w0's children hold runs they fenced and have not started
    (their stages), the children and their supervisor are SIGKILLed (the supervisor stopped
    first, so it neither restarts a child nor tells one to stop). Every run they held starts
    on w1 within :data:`HANDOVER_MS` of the kill; only runs that had started on the killed
    processes may run twice; none is lost."""
    defaults = from_env({})
    cluster.env = {**cluster.env, **{k: getattr(defaults, k) for k in DEFAULTED}}
    cluster.scheduler("s0")
    supervisor = cluster.worker("w0", WORKER_POOLS, args=["--processes", "2"])
    cluster.worker("w1", SURVIVOR_POOLS)
    cluster.wait_registered(["s0", "w1"])
    names = ("w0.1", "w0.2")
    cluster.wait_for(lambda: all(cluster.registered_pid(n) for n in names), 60,
                     "w0's children registered")
    children = {cluster.registered_pid(n) for n in names}
    assert None not in children and supervisor.proc.pid not in children

    burst = Producer(cluster, lead=(1.5, 1.5), priorities=["default"], tag="burst",
                     work=lambda i: WORK_S)
    burst.enqueue(BURST)
    ids = set(burst.ids)

    def held_by_w0() -> set[int]:
        return (cluster.running_on("w0.1") | cluster.running_on("w0.2")) & ids

    def staged_on_w0() -> set[int]:
        return held_by_w0() - {r.task_id for r in cluster.ledger.runs() if r.pid in children}
    def mid_burst() -> bool:  # runs started on w0 (the burst is due), and more staged
        return (len(staged_on_w0()) >= 10
                and sum(1 for r in cluster.ledger.runs() if r.pid in children) >= 4)
    assert wait_until(mid_burst, 20, 0.02), (
        f"w0's children never held 10 staged runs mid-burst\n{cluster.tails()}")

    beats = cluster.query("SELECT node_id, heartbeat_at FROM ax_node WHERE node_id LIKE 'w0.%'")
    os.kill(supervisor.proc.pid, signal.SIGSTOP)  # no restart, no stop order to a child
    for pid in children:
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        cluster.killed.add(pid)
    cluster.kill(supervisor)  # SIGKILL (a stopped process dies of it too)
    killed_at = now_ms()
    held = held_by_w0()
    cluster.running_at_kill |= held
    staged = held - {r.task_id for r in cluster.ledger.runs() if r.pid in children}
    assert staged, "w0's children held no staged run when they were killed"

    verdict = judge(cluster, "SIGKILL a worker holding staged runs (default heartbeats)",
                    burst.planned, fault_start=killed_at, fault_end=killed_at + HANDOVER_MS)
    first_elsewhere = {}
    for run in sorted(cluster.ledger.runs(), key=lambda r: r.start):
        if run.task_id in held and run.pid not in cluster.killed:
            first_elsewhere.setdefault(run.task_id, run.start - killed_at)
    late = {t: first_elsewhere.get(t) for t in held
            if first_elsewhere.get(t) is None or first_elsewhere[t] > HANDOVER_MS}
    waits = sorted(first_elsewhere.values())
    verdict.extra["w0's children's last beats, before the kill (ms)"] = ", ".join(
        f"{r.node_id} {killed_at - r.heartbeat_at}" for r in beats)
    verdict.extra["held by w0's children: staged / started"] = f"{len(staged)} / {len(held - staged)}"
    verdict.extra["held runs started elsewhere, after the kill (ms)"] = (
        f"first {waits[0]}, last {waits[-1]}" if waits else "none")
    conclude(cluster, verdict, allow_twice_on_killed_pid=True)
    assert not late, f"held runs not started elsewhere within {HANDOVER_MS} ms: {late}"
    twice_staged = {t for t in staged if len(cluster.ledger.by_task().get(t, [])) > 1}
    assert not twice_staged, f"staged (never started) runs that ran twice: {twice_staged}"
