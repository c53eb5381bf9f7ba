"""Staged is not run (issue 22 item 7): a worker killed while it only *staged* a run
(fenced RUNNING, waiting for a thread) must not have that run counted as one that
happened. Real processes, a real SIGKILL, and the ledger.

The worker lists the staged runs its lane will not reach soon (``ax_node.listed_runs``,
:mod:`ax_kombu.worker.listing`: a listed run starts only after a write without it); the
recovery gives those a new attempt as if they had never been sent, and counts a retry —
FAILED when none is left — for every other RUNNING task.
"""

from __future__ import annotations

import pytest

from ax_kombu.store.recovery import UNSTARTED_ERROR

from ..waiting import wait_until
from .cluster import WORKER_POOLS, Cluster
from .judge import conclude, judge
from .producer import Producer
from .timing import now_ms

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.integration]

#: one slow thread: while the sleeper runs, the other slow tasks can only be staged
ONE_SLOW_THREAD = WORKER_POOLS.replace("slow=4", "slow=1")
SLEEP_S = 60.0


@pytest.mark.timeout(120)
def test_a_worker_killed_with_listed_staged_runs_counts_no_retry_for_them(
        cluster: Cluster) -> None:
    """w0 has one slow thread. A sleeper (max_retry 0) takes it; six more slow tasks
    (three with max_retry 0, then three with 2) are due just after; four can only wait in
    the stage, fenced RUNNING on w0, the others in the broker. w0 is SIGKILLed; w1 starts.

    The sleeper started (the ledger says so): it counts as run, and with no retry left
    it ends FAILED "worker lost". The staged ones never started: each gets a new attempt
    with ``retry_count`` still 0, runs once on w1 and succeeds, and its history says why.
    Before staged runs were listed, every staged one counted a retry, and those with
    max_retry 0 ended FAILED "worker lost" without ever having run."""
    cluster.scheduler("s0")
    # a stage of 4 runs behind the one thread (its horizon at the unmeasured 1 s run time)
    cluster.worker("w0", concurrency=ONE_SLOW_THREAD, env={"worker_stage_horizon_ms": 4500})
    cluster.wait_registered(["s0", "w0"])
    victim = cluster.daemon("w0")
    sleeper = Producer(cluster, lead=(0.3, 0.3), priorities=["slow"], tag="sleep",
                       options={"max_retry": 0}, work=lambda i: SLEEP_S)
    sleeper.enqueue(1)
    strict = Producer(cluster, lead=(0.6, 0.7), priorities=["slow"], tag="strict", seed=3,
                      options={"max_retry": 0}, work=lambda i: 0.05)
    strict.enqueue(3)
    lenient = Producer(cluster, lead=(0.8, 1.0), priorities=["slow"], tag="lenient", seed=4,
                       options={"max_retry": 2}, work=lambda i: 0.05)
    lenient.enqueue(3)
    [sleeper_id] = sleeper.ids
    waiting = set(strict.ids) | set(lenient.ids)

    def staged_on_w0() -> set[int]:
        return {r.task_id for r in cluster.query(
            "SELECT task_id FROM ax_task WHERE status = 'RUNNING' AND owner_node = 'w0' "
            "AND task_id = ANY(:ids)", ids=list(waiting))}

    def staging() -> bool:
        started = {r.task_id for r in cluster.ledger.runs() if r.pid == victim.proc.pid}
        return sleeper_id in started and bool(staged_on_w0())
    assert wait_until(staging, 15, 0.02), (
        f"w0 never ran the sleeper while it had staged runs\n{cluster.tails()}")
    last_due = max(p.trigger for p in strict.planned + lenient.planned)

    def listed_now() -> set[int]:
        value = cluster.query("SELECT listed_runs FROM ax_node WHERE node_id = 'w0'")[0].listed_runs
        return {t for t in waiting if f",{t}," in (value or "")}
    # the lane lists its stage once the sleeper has run past the horizon (1 s)
    assert wait_until(lambda: now_ms() > last_due + 300 and listed_now() >= staged_on_w0(), 10,
                0.05), f"w0 did not list its staged runs\n{cluster.tails()}"
    listed = staged_on_w0()
    killed_at = cluster.kill_node("w0")
    ran_on_w0 = {r.task_id for r in cluster.ledger.runs() if r.pid == victim.proc.pid}
    assert len(listed) >= 3 and not listed & ran_on_w0, (
        f"the scenario did not happen: staged {sorted(listed)}, started on w0 "
        f"{sorted(ran_on_w0)}")
    cluster.worker("w1", concurrency=ONE_SLOW_THREAD)

    planned = sleeper.planned + strict.planned + lenient.planned
    verdict = judge(cluster, "SIGKILL a worker with listed staged runs (one slow thread)", planned,
                    fault_start=killed_at, fault_end=killed_at, expect_failed=[sleeper_id])
    rows = cluster.task_rows()
    runs = cluster.ledger.by_task()
    verdict.extra["staged on w0 when killed"] = len(listed)
    conclude(cluster, verdict, allow_twice_on_killed_pid=True)

    assert rows[sleeper_id].status == "FAILED" and rows[sleeper_id].last_error == "worker lost", (
        f"the sleeper started on w0 and had no retry left: {rows[sleeper_id]}")
    wrong = {t: (rows[t].status, rows[t].retry_count, rows[t].last_error) for t in listed
             if rows[t].status != "SUCCESS" or rows[t].retry_count != 0}
    assert not wrong, f"staged runs counted as run when w0 died: {wrong}"
    assert all(len(runs[t]) == 1 and runs[t][0].node == "w1" for t in listed), (
        {t: [r.brief() for r in runs.get(t, [])] for t in listed})
    history = {r.task_id: r.error for r in cluster.query(
        "SELECT task_id, error FROM ax_attempt WHERE outcome = 'LOST' AND task_id = ANY(:ids)",
        ids=[sleeper_id, *listed])}
    assert history == {sleeper_id: "worker lost", **dict.fromkeys(listed, UNSTARTED_ERROR)}
