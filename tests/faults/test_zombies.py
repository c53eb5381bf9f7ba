"""Zombies (issue 22 item 5): a node paused past its silence window, then resumed, must not
act on what was taken over meanwhile. Real processes, real SIGSTOP/SIGCONT, and the ledger.

Every action a node takes on shared state is fenced by its live incarnation, or by the
attempt that incarnation was given, at the moment it is taken:

* a **scheduler** publishes a claimed batch only while its lease covers the incarnation
  that claimed it (:mod:`ax_kombu.scheduler.dispatcher`): a zombie drops what it claimed
  before it was declared dead; a claim is one compare-and-set (a new attempt each), and
  a worker starts a message only at the row's current attempt; what the zombie had loaded in
  its wheel was released when it was declared dead, and a peer claims it;
* a **worker** starts a staged run only while its lease covers the incarnation that fenced
  it (:class:`ax_kombu.core.lease.Lease`), and an outcome is written only where the
  row is still RUNNING at the run's attempt (:mod:`ax_kombu.store.transitions`).

**Timing.** The issue measured a 25 s stop under the default liveness settings (5 s × 3 =
15 s of silence before a node is dead). Here every daemon runs the suite's short settings
(:data:`tests.faults.cluster.SHORT`: 1 s × 3 = 3 s, recovery every second, ack timeout
3 s): the scheduler is stopped 8 s, the worker until the cluster has declared it dead and
another worker runs what it had staged or running (about 4 s). Either way the stop outlasts the silence
window and the recovery that acts on it, which is all the 25 s stop did (a longer stop
changes nothing more: the lease and the beats run on the monotonic clock, which counts
the stop), and each test stays under about 40 s.
"""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from ax_kombu.store.preload import Share

from ..ledger import Run
from ..waiting import wait_until
from .cluster import DEAD_WINDOW_MS, Cluster
from .judge import EARLY_TOLERANCE_MS, conclude, judge
from .producer import Producer
from .proxy import TcpProxy
from .test_faults import logged
from .timing import now_ms
from .verdict import Verdict

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.integration]

#: the most claim_lead_ms allows: ax tasks are claimed, published and fenced up to 1 s early
LEAD_ENV = {"claim_lead_ms": 1000}
#: steady load of the scheduler test (tasks/s)
RATE = 100


def taken_by(cluster: Cluster, name: str, live: list[str]) -> dict[str, dict[int, int]]:
    """What scheduler ``name`` has in the table, by status: task id -> attempt. DISPATCHING:
    what it claimed; DELAYED/READY: the claimable tasks of its share among the schedulers
    ``live`` (:class:`ax_kombu.store.preload.Share`), which its wheel holds once read."""
    out: dict[str, dict[int, int]] = {}
    for r in cluster.query("SELECT task_id, status, attempt FROM ax_task WHERE owner_node = :n "
                           "AND status = 'DISPATCHING'", n=name):
        out.setdefault(r.status, {})[r.task_id] = r.attempt
    for r in cluster.query("SELECT task_id, status, attempt FROM ax_task WHERE status IN "
                           "('DELAYED', 'READY') AND NOT parked"
                           f"{Share.among(live, name).sql()}"):
        out.setdefault(r.status, {})[r.task_id] = r.attempt
    return out


#: the schedulers of the scheduler test
PAIR = ["s0", "s1"]


def _waiting(cluster: Cluster, task_ids: list[int]) -> list[int]:
    """Those of ``task_ids`` still claimable, or DISPATCHING by s0: not yet taken over."""
    return [r.task_id for r in cluster.query(
        "SELECT task_id FROM ax_task WHERE task_id = ANY(:ids) AND (status IN "
        "('DELAYED', 'READY') OR (status = 'DISPATCHING' AND owner_node = 's0'))",
        ids=task_ids)]


def fenced_after(cluster: Cluster, name: str, after_ms: int) -> dict[int, tuple[int, str]]:
    """RUNNING tasks of ``name`` due after ``after_ms``: fenced, not started (never early);
    task id -> (attempt, priority)."""
    return {r.task_id: (r.attempt, r.priority) for r in cluster.query(
        "SELECT task_id, attempt, priority FROM ax_task WHERE status = 'RUNNING' "
        "AND owner_node = :n AND trigger_time > :t", n=name, t=after_ms)}


def logged_runs(daemon_log: Path, message: str) -> set[tuple[int, int]]:
    """(task_id, attempt) of each line of a daemon's log that contains ``message``."""
    try:
        lines = daemon_log.read_text(errors="replace").splitlines()
    except OSError:
        return set()
    found = set()
    for line in lines:
        if message in line:
            task = re.search(r"\btask_id=(\d+)", line)
            attempt = re.search(r"\battempt=(\d+)", line)
            if task and attempt:
                found.add((int(task.group(1)), int(attempt.group(1))))
    return found


def _in_flight(cluster: Cluster, name: str, claimed: dict[int, int]) -> set[int]:
    """Of the tasks ``name`` had claimed and not published when it was stopped, those of
    the batch its dispatcher was publishing (its oldest claim: batches go out in order):
    that publish began before the stop, its first message already on the wire."""
    rows = cluster.query("SELECT task_id, dispatched_at FROM ax_task WHERE status = "
                         "'DISPATCHING' AND owner_node = :n", n=name)
    times = {r.task_id: r.dispatched_at for r in rows if r.task_id in claimed}
    oldest = min(times.values(), default=None)
    return {t for t, at in times.items() if at == oldest}


def refused_messages(cluster: Cluster, worker_names: list[str]) -> set[tuple[int, int]]:
    """(task id, attempt) of every message a worker refused (not run): a stale attempt,
    a task no longer DISPATCHING."""
    return set().union(*(logged_runs(cluster.daemon(name).log, "message refused, not run")
                         for name in worker_names))


# -- a scheduler -------------------------------------------------------------------------------

#: how long the scheduler is stopped: the dead window, the ack timeout of what it had claimed,
#: and a few recovery passes
SCHEDULER_PAUSE_MS = DEAD_WINDOW_MS + 5000


class HoldingProxy(TcpProxy):
    """A :class:`~tests.faults.proxy.TcpProxy` that can hold what it carries: while
    :attr:`passing` is clear, bytes read are kept (in the pump threads) until it is set."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.passing = threading.Event()
        self.passing.set()
        super().__init__(target)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.passing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def broker_proxy(redis_broker: dict[str, str]) -> Iterator[HoldingProxy]:
    """A holding proxy to this test's Redis."""
    parts = urlsplit(redis_broker["broker_url"])
    proxy = HoldingProxy((parts.hostname or "127.0.0.1", parts.port or 6379))
    yield proxy
    proxy.passing.set()
    proxy.close()


@pytest.mark.timeout(120)
def test_sigstop_a_scheduler_with_loaded_and_claimed_tasks(cluster: Cluster,
                                                             broker_proxy: HoldingProxy) -> None:
    """s0 reaches Redis through a proxy. Under a steady load (tasks due 1–4 s ahead), once
    s0 holds tasks in its wheel (DELAYED/READY in its share), the proxy holds s0's bytes
    for half a second: its publish hangs, and what it claims meanwhile stays claimed and
    unpublished (DISPATCHING by s0, in its dispatcher's inbox). Then s0 is SIGSTOPped. s1
    declares it dead, reads its share, re-dispatches its unpublished claims at a new
    attempt (ack timeout); the workers run them. s0 is SIGCONTed, and its bytes pass again:
    its dispatcher publishes the claims it lost, its wheel fires, its claimer claims,
    until its first beat finds it fenced.

    Judged from the ledger: every task once, none twice for one attempt, none early, none
    lost; every task s0 had loaded or claimed runs once. And from the workers' logs: s0 publishes none of
    the claims it lost after SIGCONT. The batch whose publish was under way when the
    proxy kept it (its oldest claim) is the exception: its first message was on the wire
    before the stop (a fence cannot call back what was sent; the publish is checked once
    per batch, as it starts), and what of it arrives is refused (a stale attempt).

    Without the fences this fails: without the dispatcher's lease check (before it, on
    main up to this test) s0 published its lost claims on SIGCONT (6 of 6 in the first
    run), refused by the workers only because a worker's RUNNING move is fenced by the
    attempt (``start_many``) — without that too, each would have run a second time after
    its re-dispatch had run; if a claim were not one compare-and-set (DELAYED/READY ->
    DISPATCHING, attempt + 1), s0's wheel firing on SIGCONT would claim and publish
    tasks s1 had already claimed and run."""
    cluster.env = {**cluster.env, **LEAD_ENV}
    broker_url = cluster.broker["broker_url"]
    cluster.scheduler("s0", env={"broker_url": broker_proxy.url(broker_url)})
    cluster.scheduler("s1")
    for name in ("w0", "w1"):
        cluster.worker(name)
    cluster.wait_registered(["s0", "s1", "w0", "w1"])
    victim = cluster.daemon("s0")
    incarnation = cluster.node("s0").incarnation
    load = Producer(cluster, rate=RATE, duration=5, lead=(1.0, 4.0)).start()
    try:
        t0 = time.monotonic()
        wait_until(lambda: time.monotonic() - t0 > 1.5 and len(taken_by(cluster, "s0", PAIR).get(
            "DELAYED", {})) >= 20, 10, 0.05)
        broker_proxy.passing.clear()  # s0's publish hangs; its claims pile up unpublished
        time.sleep(0.5)
        cluster.signal(victim, signal.SIGSTOP)
        stop_at = now_ms()
        try:
            time.sleep(0.2)  # a claim sent just before the stop is committed by now
            taken = taken_by(cluster, "s0", PAIR)  # exact: s0 is frozen
            wheel = {**taken.get("DELAYED", {}), **taken.get("READY", {})}
            claimed = taken.get("DISPATCHING", {})
            in_flight = _in_flight(cluster, "s0", claimed)
            assert wheel and claimed, (f"s0 had {len(wheel)} tasks in its wheel and "
                                       f"{len(claimed)} claimed when stopped\n{cluster.tails()}")
            taken = wait_until(lambda: cluster.node("s0").stopped_at is not None
                         and not _waiting(cluster, [*wheel, *claimed]), 15, 0.1)
            taken_at = now_ms()
            assert taken, f"s0's tasks were not taken over while it was stopped\n{cluster.tails()}"
            time.sleep(max(0.0, (stop_at + SCHEDULER_PAUSE_MS - now_ms()) / 1000))
            refused_before = refused_messages(cluster, ["w0", "w1"])
        finally:
            cluster.signal(victim, signal.SIGCONT)
            time.sleep(0.05)
            broker_proxy.passing.set()
        resumed_at = now_ms()
        cluster.wait_for(lambda: (row := cluster.node("s0")) is not None
                         and row.stopped_at is None and row.incarnation != incarnation, 15,
                         "s0 registered anew after SIGCONT")
        back_at = now_ms()
    finally:
        load.stop()
    assert not load.errors, f"the producer failed: {load.errors[:3]}"
    after = Producer(cluster, rate=RATE, duration=1.5, lead=(0.5, 1.0), tag="after",
                     seed=11).start()
    after.join()
    verdict = judge(cluster, f"SIGSTOP a scheduler holding its wheel and unpublished claims "
                    f"({SCHEDULER_PAUSE_MS // 1000} s)", load.planned + after.planned,
                    fault_start=stop_at, fault_end=back_at)
    runs = cluster.ledger.runs()
    refused_after = refused_messages(cluster, ["w0", "w1"]) - refused_before
    zombie = {(t, a) for t, a in refused_after if claimed.get(t) == a and t not in in_flight}
    on_the_wire = {(t, a) for t, a in refused_after if claimed.get(t) == a and t in in_flight}
    taken_runs = [r for r in runs if r.task_id in wheel or r.task_id in claimed]
    verdict.extra["s0's when stopped: in its wheel / claimed, unpublished (of them in "
                  "the publish under way)"] = f"{len(wheel)} / {len(claimed)} ({len(in_flight)})"
    verdict.extra["declared dead and taken over / SIGCONT / registered anew"] = (
        f"{taken_at - stop_at} / {resumed_at - stop_at} / {back_at - stop_at} ms after the stop")
    verdict.extra["s0's tasks: runs / distinct tasks run"] = (
        f"{len(taken_runs)} / {len({r.task_id for r in taken_runs})}")
    verdict.extra["s0's claims: run at the attempt s0 claimed / at a later one"] = (
        f"{sum(1 for r in runs if claimed.get(r.task_id) == r.attempt)} / "
        f"{sum(1 for r in runs if r.task_id in claimed and r.attempt > claimed[r.task_id])}")
    verdict.extra["messages the workers refused after SIGCONT / s0's lost claims from the "
                  "publish under way at the stop / published after SIGCONT"] = (
        f"{len(refused_after)} / {len(on_the_wire)} / {len(zombie)}")
    verdict.extra["s0's log: declared dead / claims not published"] = (
        f"{victim.tail(1000).count('this node was declared dead')} / "
        f"{sum(logged(victim.log, 'not published', 'count'))}")
    problems = [(f"s0 published {len(zombie)} claims after it had lost them: "
                 f"{sorted(zombie)[:5]}")] if zombie else []
    verdict.extra["publish fence"] = problems or "kept"
    conclude(cluster, verdict)
    assert not problems, problems


# -- a worker ----------------------------------------------------------------------------------

#: the runs a worker holds RUNNING when stopped: they sleep through the pause, and their
#: re-runs on the other worker (at a new attempt) are still running when the victim resumes
SLEEPERS = 3
SLEEP_S = 4.0
#: tasks due together 1.5-1.6 s after they are enqueued: published and fenced ~1 s ahead,
#: staged by the victim when it is stopped
STAGED = 60


def open_runs(runs: list[Run], pid: int) -> dict[int, int]:
    """Runs of process ``pid`` that started and did not end: task id -> attempt."""
    return {r.task_id: r.attempt for r in runs if r.pid == pid and r.end is None}


@pytest.mark.timeout(120)
def test_sigstop_a_worker_with_staged_and_running_tasks(cluster: Cluster) -> None:
    """w0 (the only worker) holds SLEEPERS running tasks (each sleeps SLEEP_S) and STAGED
    staged ones (fenced RUNNING, waiting for their trigger time) when it is SIGSTOPped. w1
    starts; the cluster declares w0 dead, gives every one of those tasks another attempt,
    and w1 runs them. w0 is SIGCONTed once w1 is running the sleepers' new attempts.

    On SIGCONT: w0 must start none of the staged runs (its lease ran out; its failed beat
    withdraws the stage), its sleepers return (a process paused mid-run goes on: that run
    is at-least-once, as for a SIGKILL mid-task), and each sleeper's outcome it writes
    must be refused: the row is RUNNING on w1 at a later attempt, and only the attempt
    tells the two apart. The row's end is w1's. Then w0 registers anew and takes work.

    Without the fences this fails: without the lease check at start (``Lease.covers``)
    w0 starts the staged runs it had at their old attempt after w1 ran them (the
    issue's measurement: two of them); without the attempt in the outcome's
    compare-and-set (``finish_many``), w0's outcome ends the row while w1's run of the
    new attempt goes on, and w1's own outcome is then refused (the row's end is w0's).

    This is the suite's one SIGSTOP of a worker (it was also test_faults.py's
    ``test_sigstop_a_worker_holding_staged_runs``, whose checks are here too): w0 logs that
    it was declared dead, and no run starts before the producer's planned time."""
    cluster.env = {**cluster.env, **LEAD_ENV}
    for name in ("s0", "s1"):
        cluster.scheduler(name)
    cluster.worker("w0")
    cluster.wait_registered(["s0", "s1", "w0"])
    victim = cluster.daemon("w0")
    incarnation = cluster.node("w0").incarnation
    sleepers = Producer(cluster, lead=(0.5, 0.5), options={"priority": "slow"}, tag="sleep",
                        work=lambda i: SLEEP_S)
    sleepers.enqueue(SLEEPERS)
    staged_load = Producer(cluster, lead=(1.5, 1.6), tag="staged", seed=8)
    staged_load.enqueue(STAGED)
    first_due = min(p.trigger for p in staged_load.planned)

    def holding() -> bool:
        running = open_runs(cluster.ledger.runs(), victim.proc.pid)
        return (len(running) >= SLEEPERS and len(fenced_after(cluster, "w0", now_ms())) >= STAGED
                or now_ms() >= first_due - 250)
    wait_until(holding, 10, 0.01)
    cluster.signal(victim, signal.SIGSTOP)
    stop_at = now_ms()
    try:
        time.sleep(0.3)  # a RUNNING move sent just before the stop is committed by now
        staged = {t: a for t, (a, _) in fenced_after(cluster, "w0", stop_at).items()}
        running = open_runs(cluster.ledger.runs(), victim.proc.pid)
        assert staged and len(running) == SLEEPERS and set(running) == set(sleepers.ids), (
            f"w0 had {len(staged)} staged and {sorted(running)} running (of sleepers "
            f"{sleepers.ids}) when stopped: the scenario did not happen\n{cluster.tails()}")
        cluster.worker("w1")

        def rerun_on_w1() -> bool:
            runs = cluster.ledger.runs()
            return (cluster.node("w0").stopped_at is not None
                    and all(any(r.task_id == t and r.node == "w1" and r.attempt > a
                                for r in runs) for t, a in running.items()))
        taken = wait_until(rerun_on_w1, 20, 0.05)
        taken_at = now_ms()
        assert taken, f"w1 did not run w0's sleepers while it was stopped\n{cluster.tails()}"
    finally:
        cluster.signal(victim, signal.SIGCONT)
    resumed_at = now_ms()
    cluster.wait_for(lambda: (row := cluster.node("w0")) is not None and row.stopped_at is None
                     and row.incarnation != incarnation and row.pid == victim.proc.pid, 15,
                     "w0 registered anew after SIGCONT")
    back_at = now_ms()
    after = Producer(cluster, rate=RATE, duration=1.5, lead=(0.5, 1.0), tag="after", seed=11)
    after.start().join()
    assert not after.errors, f"the producer failed: {after.errors[:3]}"

    planned = sleepers.planned + staged_load.planned + after.planned
    verdict = judge(cluster, f"SIGSTOP a worker holding staged and running tasks "
                    f"({(resumed_at - stop_at) / 1000:.0f} s)", planned, fault_start=stop_at,
                    fault_end=back_at)
    problems = _worker_fences(cluster, verdict, victim.log, victim.proc.pid, staged, running,
                              {p.task_id for p in after.planned})
    verdict.extra["w0's when stopped: staged / running"] = f"{len(staged)} / {len(running)}"
    verdict.extra["w1 running the sleepers / SIGCONT / w0 registered anew"] = (
        f"{taken_at - stop_at} / {resumed_at - stop_at} / {back_at - stop_at} ms after the stop")
    verdict.extra["zombie fences"] = problems or "kept"
    conclude(cluster, verdict)
    assert not problems, problems


def _worker_fences(cluster: Cluster, verdict: Verdict, log: Path, pid: int, staged: dict[int, int],
                   running: dict[int, int], after_ids: set[int]) -> list[str]:
    """The zombie worker's invariants beyond the verdict's (see the test's docstring). The
    sleepers ran twice, the first run frozen through the pause and overlapping the second:
    at-least-once, as for a SIGKILL mid-task; they leave the verdict's "ran twice" and
    "two runs at once" and are judged here."""
    runs = cluster.ledger.runs()
    rows = cluster.task_rows(running)
    problems: list[str] = []
    started_staged = sorted((r.task_id, r.attempt) for r in runs
                            if staged.get(r.task_id) == r.attempt)
    if started_staged:
        problems.append(f"{len(started_staged)} staged runs of w0 started at that attempt "
                        f"after they were taken over: {started_staged[:5]}")
    stale = logged_runs(log, "result not recorded")
    while_w1_ran = 0
    for task_id, attempt in running.items():
        mine = [r for r in runs if r.task_id == task_id and r.pid == pid]
        theirs = [r for r in runs if r.task_id == task_id and r.node == "w1"]
        row = rows[task_id]
        if not theirs or row.status != "SUCCESS" or row.attempt != theirs[-1].attempt:
            problems.append(f"task {task_id}: row {row.status} at attempt {row.attempt}, "
                            f"w1 ran {[r.attempt for r in theirs]}")
            continue
        if any(r.end is None for r in mine) or (task_id, attempt) not in stale:
            problems.append(f"task {task_id}: w0's outcome for attempt {attempt} was not "
                            f"refused ({'never ended' if any(r.end is None for r in mine) else 'written'})")
        end = theirs[-1].end or 0
        if row.finished_at < end - EARLY_TOLERANCE_MS:
            problems.append(f"task {task_id}: the row ended at {row.finished_at}, before w1's "
                            f"run did ({end}): w0's outcome was recorded")
        while_w1_ran += sum(1 for r in mine if r.end is not None and r.end < end)
        verdict.ran_twice.pop(task_id, None)
        verdict.overlapping.pop(task_id, None)
    if not while_w1_ran:
        problems.append("no sleeper of w0 ended while w1 still ran it: the attempt fence was "
                        "not exercised (the scenario did not happen)")
    if not any(r.task_id in after_ids for r in runs if r.pid == pid):
        problems.append("w0 ran nothing after it registered anew")
    early_planned = sorted(r.task_id for r in runs if r.planned is not None
                           and r.start < r.planned - EARLY_TOLERANCE_MS)
    if early_planned:
        problems.append(f"{len(early_planned)} tasks started before their planned trigger "
                        f"time: {early_planned[:5]}")
    withdrawn = logged(log, "declared dead", "withdrawn")
    if not withdrawn:
        problems.append("w0 never logged that it was declared dead")
    verdict.extra["sleepers: w0's outcomes refused (result not recorded) / written while w1 "
                  "still ran the new attempt"] = (
        f"{sum(1 for t, a in running.items() if (t, a) in stale)} / {while_w1_ran}")
    verdict.extra["staged runs started at the attempt w0 had"] = len(started_staged)
    verdict.extra["w0's log: stage withdrawn"] = withdrawn
    return problems
