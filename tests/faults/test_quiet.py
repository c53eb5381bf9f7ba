"""A quiet worker (issue 40): ``ax workers quiet w0`` or SIGTSTP, with real processes on
PostgreSQL and Redis, counted by the ledger.

w0 and w1 each have one slow thread and a stage behind it; a burst of slow tasks due at
once leaves runs staged on w0 (fenced RUNNING, not started). Once w0 is quiet: it starts
nothing new (no ledger start on its pid after its heartbeat said quiet), the runs it had
staged run on w1, every task runs exactly once and succeeds, and w0 goes on heartbeating.
``ax workers resume w0`` makes it take work again.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from tests.integration.ax_cli import Ax

from .cluster import WORKER_POOLS, Cluster
from .producer import Producer
from .timing import now_ms

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.integration]

#: one slow thread: while it runs, the other slow tasks can only be staged
ONE_SLOW_THREAD = WORKER_POOLS.replace("slow=4", "slow=1")
#: short beats, so a quiet takes effect in well under a second; a silence window of 3 s
FAST_BEATS: dict[str, Any] = {"heartbeat_interval_s": 0.3, "heartbeat_misses": 10}
#: a stage of several runs behind the one thread (the horizon at the unmeasured 1 s run time)
STAGING = {**FAST_BEATS, "worker_stage_horizon_ms": 4500}
BURST = 12
WORK_S = 1.0


def _start(cluster: Cluster) -> Ax:
    cluster.scheduler("s0", env=FAST_BEATS)
    for name in ("w0", "w1"):
        cluster.worker(name, concurrency=ONE_SLOW_THREAD, env=STAGING)
    cluster.wait_registered(["s0", "w0", "w1"])
    return Ax(cluster.database_url)


def _staged_on(cluster: Cluster, node: str, ids: list[int]) -> set[int]:
    """Tasks RUNNING on ``node`` whose processor has not started (the ledger says)."""
    running = {r.task_id for r in cluster.query(
        "SELECT task_id FROM ax_task WHERE status = 'RUNNING' AND owner_node = :n "
        "AND task_id = ANY(:ids)", n=node, ids=ids)}
    return running - {r.task_id for r in cluster.ledger.runs()}


def _burst(cluster: Cluster, tag: str, n: int = BURST) -> Producer:
    burst = Producer(cluster, lead=(0.4, 0.5), priorities=["slow"], tag=tag, seed=len(tag),
                     options={"max_retry": 0}, work=lambda i: WORK_S)
    burst.enqueue(n)
    return burst


def _quiet_seen(cluster: Cluster, node: str) -> int:
    """Wait until ``node``'s heartbeat says it is quiet; returns when that was seen (ms)."""
    cluster.wait_for(lambda: cluster.node_info(node).get("quiet") is True, 10,
                     f"{node} quiet in its heartbeat")
    return now_ms()


def _hold_staged(cluster: Cluster, ids: list[int]) -> set[int]:
    """Wait until w0 holds at least two staged runs; returns them."""
    def staged() -> set[int] | None:
        found = _staged_on(cluster, "w0", ids)
        return found if len(found) >= 2 else None
    return cluster.wait_for(staged, 15, "w0 holding staged runs")


def _check_drained(cluster: Cluster, ids: list[int], staged: set[int], seen_ms: int) -> None:
    """After w0 went quiet (seen at ``seen_ms``): everything ran once, nothing new on w0."""
    w0_pid = cluster.daemon("w0").proc.pid
    cluster.wait_for(lambda: cluster.status_of(ids)["SUCCESS"] == len(ids), 40,
                     "the burst done", detail=lambda: cluster.status_of(ids))
    runs = cluster.ledger.by_task()
    twice = {t: [r.brief() for r in runs.get(t, [])] for t in ids if len(runs.get(t, [])) != 1}
    assert not twice, f"not run exactly once: {twice}"
    late_on_w0 = [runs[t][0].brief() for t in ids
                  if runs[t][0].pid == w0_pid and runs[t][0].start > seen_ms]
    assert not late_on_w0, f"w0 started work after it was quiet: {late_on_w0}"
    # a staged run may still start on w0 between the look at its stage and the quiet
    moved = {t for t in staged if runs[t][0].pid != w0_pid}
    assert moved and all(runs[t][0].node == "w1" for t in moved), (
        f"w0's staged runs did not move to w1: {[runs[t][0].brief() for t in staged]}")
    row = cluster.node("w0")
    assert row.stopped_at is None and row.quiet_at is not None and cluster.daemon("w0").alive
    beat = row.heartbeat_at
    cluster.wait_for(lambda: cluster.node("w0").heartbeat_at > beat, 5, "w0 beating while quiet")


def _check_resumed(cluster: Cluster, ax: Ax) -> None:
    """``ax workers resume w0`` (and w1 quiet): w0 takes the next tasks."""
    assert "w0: resumed" in ax.ok("workers", "resume", "w0")
    ax.ok("workers", "quiet", "w1")
    cluster.wait_for(lambda: cluster.node_info("w0").get("quiet") is False
                     and cluster.node_info("w1").get("quiet") is True, 10, "w0 live, w1 quiet")
    after = _burst(cluster, "after", 3)
    cluster.wait_for(lambda: cluster.status_of(after.ids)["SUCCESS"] == 3, 20,
                     "the tasks after the resume done", detail=lambda: cluster.status_of(after.ids))
    runs = cluster.ledger.by_task()
    assert {runs[t][0].node for t in after.ids} == {"w0"}, [runs[t][0].brief()
                                                           for t in after.ids]
    audit = [(r.action, r.target) for r in cluster.query(
        "SELECT action, target FROM ax_audit ORDER BY id")]
    assert ("worker_resume", "worker:w0") in audit and ("worker_quiet", "worker:w1") in audit


@pytest.mark.timeout(120)
def test_ax_workers_quiet_hands_staged_runs_to_the_other_worker(cluster: Cluster) -> None:
    ax = _start(cluster)
    burst = _burst(cluster, "burst")
    staged = _hold_staged(cluster, burst.ids)
    assert "w0: quiet" in ax.ok("workers", "quiet", "w0")
    seen = _quiet_seen(cluster, "w0")
    assert "w0  quiet" in ax.ok("workers")
    assert "QUIET" in ax.ok("status", "--no-broker")
    _check_drained(cluster, burst.ids, staged, seen)
    assert ("worker_quiet", "worker:w0") in [(r.action, r.target) for r in cluster.query(
        "SELECT action, target FROM ax_audit")]
    _check_resumed(cluster, ax)


@pytest.mark.timeout(120)
def test_sigtstp_quiets_a_worker_and_stores_it(cluster: Cluster) -> None:
    ax = _start(cluster)
    burst = _burst(cluster, "burst")
    staged = _hold_staged(cluster, burst.ids)
    cluster.signal(cluster.daemon("w0"), signal.SIGTSTP)
    seen = _quiet_seen(cluster, "w0")
    cluster.wait_for(lambda: cluster.node("w0").quiet_at is not None, 5,
                     "the quiet stored by w0's beat")
    _check_drained(cluster, burst.ids, staged, seen)
    _check_resumed(cluster, ax)


def test_quiet_refuses_an_unknown_name_and_a_scheduler(cluster: Cluster) -> None:
    cluster.scheduler("s0", env=FAST_BEATS)
    cluster.wait_registered(["s0"])
    ax = Ax(cluster.database_url)
    unknown = ax("workers", "quiet", "nobody")
    assert unknown.returncode == 2 and "no live worker named 'nobody'" in unknown.stderr
    scheduler = ax("workers", "resume", "s0")
    assert scheduler.returncode == 2 and "'s0' is a scheduler, not a worker" in scheduler.stderr
    assert cluster.query("SELECT COUNT(*) AS n FROM ax_audit")[0].n == 0
