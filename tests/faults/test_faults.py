"""Fault injection under a steady load (issue 10): real processes, real signals, loopback only.

Each test starts 2 schedulers and 2 workers (``s0 s1 w0 w1``) on PostgreSQL + Redis
(or a private RabbitMQ), runs a steady producer, injects one fault, and judges from
the ledger and the table (see :mod:`tests.faults.judge`): every task final, none
lost, none run twice (except tasks RUNNING on a SIGKILLed process, each counted and
printed), none published twice for one attempt, no two runs of a task at once, none
started early, tasks enqueued after the fault run exactly once; after a clock step,
tasks due after it are on time too. Lateness is otherwise reported, not asserted.

Run: ``.venv/bin/pytest tests/faults -p no:cacheprovider -q`` (the summary table is
printed at the end; see docs/reliability.md for today's figures).
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ..services import serving, unavailable
from .cluster import DEAD_WINDOW_MS, WORKER_POOLS, Cluster
from .faketime import Faketime
from .judge import EARLY_TOLERANCE_MS, conclude, judge
from .producer import Producer
from .proxy import TcpProxy
from .servers import PrivateRabbit, PrivateRedis
from .timing import now_ms, poll

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.integration]

#: tasks per second of the steady load
RATE = 100
#: how long after a node's death the cluster may take to act on it (dead window + recovery)
TAKEOVER_MS = DEAD_WINDOW_MS + 2000
#: restart scenarios: a node is dead after 8 s of silence, so the restarted process
#: registers while the others still count the dead one as alive (as with the default
#: 5 s x 3 and a supervisor restarting within seconds)
RESTART_ENV = {"heartbeat_misses": 8}
RESTART_WINDOW_MS = 8000


def load_then(cluster: Cluster, duration: float, fault_after: float,
              inject: Callable[[], tuple[int, int]]) -> tuple[Producer, int, int]:
    """Run the steady load for ``duration`` s; once it has run ``fault_after`` s and the
    workers are running its tasks, ``inject()`` the fault, which returns its window."""
    load = Producer(cluster, rate=RATE, duration=duration).start()
    t0 = time.monotonic()
    try:
        reached = poll(lambda: time.monotonic() - t0 >= fault_after
                       and cluster.ledger.lines() >= RATE // 2, fault_after + 20, 0.1)
        assert reached, f"the load never reached the workers\n{cluster.tails()}"
        window = inject()
    except BaseException:
        load.stop()
        raise
    load.join()
    assert not load.errors, f"the producer failed: {load.errors[:3]}"
    return load, *window


def running_on_pid(cluster: Cluster, name: str, at_least: int, timeout: float = 15) -> bool:
    """Until ``name``'s current process is in the middle of ``at_least`` runs."""
    pid = cluster.daemon(name).proc.pid

    def busy() -> bool:
        return sum(1 for r in cluster.ledger.runs() if r.pid == pid and r.end is None) >= at_least
    return bool(poll(busy, timeout, 0.02))


# -- nodes killed ------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_sigkill_a_scheduler(cluster: Cluster) -> None:
    cluster.standard()

    def kill() -> tuple[int, int]:
        at = cluster.kill_node("s0")
        return at, at + TAKEOVER_MS

    load, start, end = load_then(cluster, 10, 3, kill)
    verdict = judge(cluster, "SIGKILL a scheduler", load.planned, fault_start=start,
                    fault_end=end)
    conclude(cluster, verdict)


@pytest.mark.timeout(150)
def test_sigkill_a_worker_mid_task(cluster: Cluster) -> None:
    cluster.standard()

    def kill() -> tuple[int, int]:
        assert running_on_pid(cluster, "w0", 2), "w0 never ran two tasks at once"
        at = cluster.kill_node("w0")
        return at, at + TAKEOVER_MS

    load, start, end = load_then(cluster, 10, 3, kill)
    verdict = judge(cluster, "SIGKILL a worker mid-task", load.planned, fault_start=start,
                    fault_end=end)
    verdict.extra["RUNNING on w0 when killed / runs cut short"] = (
        f"{len(cluster.running_at_kill)} / "
        f"{sum(1 for r in cluster.ledger.runs() if r.end is None and r.pid in cluster.killed)}")
    conclude(cluster, verdict, allow_twice_on_killed_pid=True)


def restart_under_same_name(cluster: Cluster, name: str, title: str,
                            mid_task: bool) -> None:
    """SIGKILL ``name`` under load and start it again at once under the same ``-n``."""
    cluster.env = {**cluster.env, **RESTART_ENV}
    cluster.standard()
    notes: list[str] = []

    def restart() -> tuple[int, int]:
        if mid_task:
            assert running_on_pid(cluster, name, 2), f"{name} never ran two tasks at once"
        at = cluster.kill_node(name)
        cluster.start(name)
        cluster.wait_registered([name])
        back = now_ms()
        notes.append(f"{name} back {back - at} ms after the kill"
                     + ("" if back - at < RESTART_WINDOW_MS else
                        " (after the dead window: the others may have recovered it first)"))
        return at, back + 2000

    load, start, end = load_then(cluster, 10, 3, restart)
    verdict = judge(cluster, title, load.planned, fault_start=start, fault_end=end)
    verdict.notes += notes
    if mid_task:
        verdict.extra[f"RUNNING on {name} when killed / runs cut short"] = (
            f"{len(cluster.running_at_kill)} / "
            f"{sum(1 for r in cluster.ledger.runs() if r.end is None and r.pid in cluster.killed)}")
    conclude(cluster, verdict, allow_twice_on_killed_pid=mid_task)


@pytest.mark.timeout(150)
def test_restart_a_scheduler_under_the_same_name(cluster: Cluster) -> None:
    restart_under_same_name(cluster, "s0", "SIGKILL + restart a scheduler (same -n)",
                            mid_task=False)


@pytest.mark.timeout(150)
def test_restart_a_worker_under_the_same_name(cluster: Cluster) -> None:
    restart_under_same_name(cluster, "w0", "SIGKILL + restart a worker (same -n)", mid_task=True)


# -- a worker paused past its silence window ---------------------------------------------------

#: the most claim_lead_ms allows: the burst is claimed, published and fenced about 1 s before
#: it is due, so the victim holds its stage for most of a second with nothing started yet
PAUSE_ENV = {"claim_lead_ms": 1000}
#: tasks due together, 2-2.1 s after they are enqueued: more than both workers' threads and
#: stages hold at once (a lane stages what its threads finish in 1 s at its measured run time)
BURST = 400
#: w0 is stopped once it holds this many fenced runs (or 250 ms before the burst is due)
STOP_HOLDING = 40
#: how long the victim is stopped: well past the dead window and a recovery pass
PAUSE_MS = DEAD_WINDOW_MS + 5000
#: threads per lane of each worker
THREADS = {lane: int(n) for lane, n in (x.split("=") for x in WORKER_POOLS.split(","))}


def fenced_after(cluster: Cluster, name: str, after_ms: int) -> dict[int, tuple[int, str]]:
    """RUNNING tasks of ``name`` due after ``after_ms``: fenced, not started (never early);
    task id -> (attempt, priority)."""
    return {r.task_id: (r.attempt, r.priority) for r in cluster.query(
        "SELECT task_id, attempt, priority FROM ax_task WHERE status = 'RUNNING' "
        "AND owner_node = :n AND trigger_time > :t", n=name, t=after_ms)}


def logged(daemon_log: Path, message: str, field: str) -> list[int]:
    """The ``field=N`` values of the lines of a daemon's log that contain ``message``."""
    try:
        lines = daemon_log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [int(m.group(1)) for line in lines if message in line
            and (m := re.search(rf"\b{field}=(\d+)", line))]


@pytest.mark.timeout(150)
def test_sigstop_a_worker_holding_staged_runs(cluster: Cluster) -> None:
    """w0 holds a stage (runs fenced RUNNING, none started: the burst is not due yet, the
    warm-up load has ended) when it is SIGSTOPped for PAUSE_MS; the cluster declares it
    dead and gives those tasks new attempts, which w1 runs. On SIGCONT w0 must start none
    of what it held (its lease ran out; its failed heartbeat withdraws the stage), register
    anew, and take work again. Judged on the warm-up, the burst and a steady load after w0
    is back. w0 is stopped as soon as it holds STOP_HOLDING, while it is often still fencing
    the burst: a RUNNING move sent just before the stop then commits during the pause, its
    reply read only after SIGCONT."""
    cluster.env = {**cluster.env, **PAUSE_ENV}
    cluster.standard()
    victim = cluster.daemon("w0")
    incarnation = cluster.node("w0").incarnation
    # a short load first: the lanes time their runs and size their stages from that
    warm = Producer(cluster, rate=RATE, duration=2, lead=(0.5, 1.0), tag="warm").start()
    warm.join()
    assert not warm.errors, f"the producer failed: {warm.errors[:3]}"
    cluster.wait_for(lambda: set(cluster.status_of(warm.ids)) == {"SUCCESS"}, 20,
                     "the warm-up load done", detail=lambda: cluster.status_of(warm.ids))
    burst = Producer(cluster, lead=(2.0, 2.1), tag="burst", seed=8)
    burst.enqueue(BURST)
    first_due = min(p.trigger for p in burst.planned)
    seen: dict[int, tuple[int, str]] = {}

    def staging() -> bool:
        seen.clear()
        seen.update(fenced_after(cluster, "w0", now_ms()))
        return len(seen) >= STOP_HOLDING or now_ms() >= first_due - 250
    poll(staging, 10, 0.01)
    cluster.signal(victim, signal.SIGSTOP)
    stop_at = now_ms()
    try:
        time.sleep(0.3)  # what w0 sent before the stop (a RUNNING move) is committed by now
        held = fenced_after(cluster, "w0", stop_at)  # exact: w0 is frozen
        by_lane = Counter(p for _, p in held.values())
        staged = {lane: n - THREADS[lane] for lane, n in by_lane.items() if n > THREADS[lane]}
        assert staged, (f"w0 held {dict(by_lane)} fenced runs when stopped, none beyond its "
                        f"threads: the scenario did not happen\n{cluster.tails()}")
        assert not [r for r in cluster.ledger.runs() if r.pid == victim.proc.pid
                    and (r.end is None or r.start >= stop_at)], "w0 was running a task"
        taken = poll(lambda: cluster.node("w0").stopped_at is not None
                     and not cluster.running_on("w0") & held.keys(),
                     (stop_at + PAUSE_MS - now_ms()) / 1000, 0.1)
        taken_at = now_ms()
        assert taken, f"w0's tasks were not taken over while it was stopped\n{cluster.tails()}"
        time.sleep(max(0.0, (stop_at + PAUSE_MS - now_ms()) / 1000))
    finally:
        cluster.signal(victim, signal.SIGCONT)
    resumed_at = now_ms()
    cluster.wait_for(lambda: (row := cluster.node("w0")) is not None and row.stopped_at is None
                     and row.incarnation != incarnation and row.pid == victim.proc.pid, 15,
                     "w0 registered anew after SIGCONT")
    back_at = now_ms()
    after = Producer(cluster, rate=RATE, duration=3, tag="after", seed=11).start()
    after.join()
    assert not after.errors, f"the producer failed: {after.errors[:3]}"

    verdict = judge(cluster, f"SIGSTOP a worker holding staged runs ({PAUSE_MS // 1000} s)",
                    warm.planned + burst.planned + after.planned, fault_start=stop_at,
                    fault_end=back_at)
    runs = cluster.ledger.runs()
    on_victim = [r for r in runs if r.pid == victim.proc.pid and r.start >= stop_at]
    held_pairs = {(t, a) for t, (a, _) in held.items()}
    started_held = sorted((r.task_id, r.attempt) for r in runs
                          if (r.task_id, r.attempt) in held_pairs)
    early_planned = sorted(r.task_id for r in runs if r.planned is not None
                           and r.start < r.planned - EARLY_TOLERANCE_MS)
    after_ids = set(after.ids)
    withdrawn = logged(victim.log, "declared dead", "withdrawn")
    verdict.extra["fenced on w0 when stopped (by lane) / beyond its threads (staged) / seen "
                  "just before the stop"] = (
        f"{len(held)} {dict(by_lane)} / {sum(staged.values())} / {len(seen)}")
    verdict.extra["declared dead and taken over / SIGCONT / registered anew"] = (
        f"{taken_at - stop_at} / {resumed_at - stop_at} / {back_at - stop_at} ms after the stop")
    verdict.extra["w0's log: stage withdrawn / handed back (rows still its own)"] = (
        f"{withdrawn} / {logged(victim.log, 'handed back', 'count')}")
    verdict.extra["held runs started at the attempt w0 held (of them fenced after the last "
                  "look before the stop)"] = (
        f"{started_held or 0} ({sum(1 for t, _ in started_held if t not in seen)})")
    verdict.extra["held tasks run on w0 at a new attempt / on w1"] = (
        f"{sum(1 for r in on_victim if r.task_id in held and r.attempt != held[r.task_id][0])}"
        f" / {sum(1 for r in runs if r.task_id in held and r.node == 'w1')}")
    verdict.extra["tasks after w0 was back: run on w0 / on w1"] = (
        f"{sum(1 for r in on_victim if r.task_id in after_ids)} / "
        f"{sum(1 for r in runs if r.task_id in after_ids and r.node == 'w1')}")
    problems_extra = []
    if started_held:
        problems_extra.append(f"{len(started_held)} runs w0 held when stopped started at that "
                              f"attempt after they were taken over: {started_held[:5]}")
    if early_planned:
        problems_extra.append(f"{len(early_planned)} tasks started before their planned "
                              f"trigger time: {early_planned[:5]}")
    if not withdrawn:
        problems_extra.append("w0 never logged that it was declared dead")
    if not any(r.task_id in after_ids for r in on_victim):
        problems_extra.append("w0 ran nothing after it registered anew")
    verdict.extra["stage invariants"] = problems_extra or "held"
    conclude(cluster, verdict)
    assert not problems_extra, problems_extra


# -- the database ------------------------------------------------------------------------------

def cut_database(cluster: Cluster, proxy: TcpProxy, seconds: float) -> Callable[[],
                                                                                 tuple[int, int]]:
    def cut() -> tuple[int, int]:
        at = now_ms()
        proxy.cut(seconds)
        back = poll(lambda: not proxy.refusing, seconds + 5, 0.1)
        assert back
        return at, now_ms()
    return cut


@pytest.mark.timeout(200)
def test_database_cut_for_20s(proxied_cluster: Cluster, proxy: TcpProxy) -> None:
    cluster = proxied_cluster
    cluster.standard()
    load, start, end = load_then(cluster, 29, 3, cut_database(cluster, proxy, 20))
    verdict = judge(cluster, "database cut 20 s (proxy)", load.planned, fault_start=start,
                    fault_end=end + 2000, deadline_s=30)
    verdict.extra["connections cut / refused"] = f"{proxy.cut_connections} / {proxy.refused}"
    conclude(cluster, verdict)


@pytest.mark.timeout(150)
def test_postgresql_restart(proxied_cluster: Cluster, proxy: TcpProxy) -> None:
    """A restart of PostgreSQL as clients see it (every connection closed, none accepted
    for 4 s), simulated by the proxy: the shared server is never stopped."""
    cluster = proxied_cluster
    cluster.standard()
    load, start, end = load_then(cluster, 12, 3, cut_database(cluster, proxy, 4))
    verdict = judge(cluster, "PostgreSQL restart (proxy cut 4 s)", load.planned,
                    fault_start=start, fault_end=end + 2000)
    verdict.extra["connections cut / refused"] = f"{proxy.cut_connections} / {proxy.refused}"
    conclude(cluster, verdict)


# -- the brokers -------------------------------------------------------------------------------

@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    try:
        server = PrivateRedis(tmp_path)
        server.start()
    except (RuntimeError, OSError) as exc:
        unavailable("a private redis-server", exc)
    yield server
    server.stop()


@pytest.mark.timeout(150)
def test_redis_restart(pg_url: str, private_redis: PrivateRedis, tmp_path: Path) -> None:
    """A private redis-server (no persistence) stopped for 3 s and started again: the
    messages it held are gone; the ack timeout must dispatch those tasks again."""
    broker = {"broker_url": private_redis.url, "broker_key_prefix": "axfault:"}
    broker_outage(Cluster(pg_url, broker, tmp_path),
                  "Redis restart (private, 3 s down, data lost)",
                  private_redis.stop, private_redis.start)


def broker_outage(cluster: Cluster, title: str, stop: Callable[[], None],
                  start: Callable[[], None]) -> None:
    """Under the standard load, the broker is down for 3 s (``stop``, then ``start``)."""
    try:
        cluster.standard()

        def restart() -> tuple[int, int]:
            at = now_ms()
            stop()
            time.sleep(3)  # the outage itself
            start()
            return at, now_ms() + 1000

        load, fault_start, fault_end = load_then(cluster, 10, 3, restart)
        verdict = judge(cluster, title, load.planned, fault_start=fault_start,
                        fault_end=fault_end)
        conclude(cluster, verdict)
    finally:
        cluster.close()


@pytest.fixture
def private_rabbit(tmp_path: Path) -> Iterator[PrivateRabbit]:
    (tmp_path / "rabbit").mkdir()
    try:
        server = PrivateRabbit(tmp_path / "rabbit")
    except RuntimeError as exc:
        unavailable("a private RabbitMQ node", exc)
    with serving("a private RabbitMQ node", server.start, server.stop):
        yield server


@pytest.mark.timeout(200)
def test_rabbitmq_restart(pg_url: str, private_rabbit: PrivateRabbit, tmp_path: Path) -> None:
    """A private RabbitMQ node (own name, ports and data) whose broker application is
    stopped for 3 s (``rabbitmqctl stop_app`` / ``start_app``); the shared server is
    never touched."""
    def ctl(command: str) -> Callable[[], None]:
        def run() -> None:
            done = private_rabbit.ctl(command)
            assert done.returncode == 0, done.stderr
        return run

    broker_outage(Cluster(pg_url, {"broker_url": private_rabbit.url}, tmp_path),
                  "RabbitMQ restart (private, stop_app 3 s)", ctl("stop_app"), ctl("start_app"))


# -- a queue without consumer ------------------------------------------------------------------

NO_CONSUMER_S = 60
SLOW_TASKS = 50
#: most messages the broker may hold per task of a queue without consumer
MAX_MESSAGES_PER_TASK = 2


def queued(cluster: Cluster, queue: str) -> int:
    """Messages waiting in Redis list ``queue`` (under the cluster's key prefix)."""
    import redis

    client = redis.Redis.from_url(cluster.settings.broker_url)
    try:
        return int(client.llen(cluster.settings.broker_key_prefix + queue))
    finally:
        client.close()


@pytest.mark.timeout(220)
def test_a_queue_without_consumer_for_60s(cluster: Cluster) -> None:
    cluster.standard(queues="high,default")
    slow = Producer(cluster, lead=(1.0, 2.0), options={"priority": "slow"}, tag="slow",
                    work=lambda i: 0.02)
    slow_ids = set(slow.enqueue(SLOW_TASKS))
    load = Producer(cluster, rate=RATE, duration=10).start()
    start = min(p.trigger for p in slow.planned)
    samples: list[int] = []
    queue = cluster.settings.queue_slow
    until = time.monotonic() + NO_CONSUMER_S + 2
    while time.monotonic() < until:  # sampling the broker for the whole window
        samples.append(queued(cluster, queue))
        time.sleep(0.5)
    load.join()
    attempts_before = {r.task_id: r.attempt for r in cluster.task_rows(slow_ids).values()}
    cluster.worker("w2", queues="slow")
    end = now_ms()
    verdict = judge(cluster, f"queue without consumer {NO_CONSUMER_S} s", slow.planned
                    + load.planned, fault_start=start, fault_end=end)
    most = max(samples)
    verdict.extra["slow tasks"] = SLOW_TASKS
    verdict.extra["most messages queued for them"] = (
        f"{most} ({most / SLOW_TASKS:.1f} per task), at the end {samples[-1]}")
    verdict.extra["attempts per slow task when the consumer came"] = (
        f"max {max(attempts_before.values())}, total {sum(attempts_before.values())}")
    problems_extra = []
    if most > MAX_MESSAGES_PER_TASK * SLOW_TASKS:
        problems_extra.append(f"the broker held {most} messages for {SLOW_TASKS} tasks "
                              f"(> {MAX_MESSAGES_PER_TASK} per task)")
    verdict.extra["broker bound"] = problems_extra or "held"
    verdict.broker_per_task = most / SLOW_TASKS
    conclude(cluster, verdict, max_late_after_ms=None)
    assert not problems_extra, problems_extra


# -- a processor over its timeout --------------------------------------------------------------

#: fewer than the workers' slow slots (2 x 4): a timed-out run keeps its slot until its
#: thread returns, so a retry can only overlap it if another slot is free
TIMEOUT_TASKS = 4


@pytest.mark.timeout(150)
def test_a_processor_over_its_timeout_never_runs_twice_at_once(cluster: Cluster) -> None:
    cluster.standard()
    over = Producer(cluster, lead=(1.0, 1.5), tag="over", work=lambda i: 1.5,
                    options={"priority": "slow", "timeout_ms": 300, "max_retry": 2})

    def enqueue_overrunning() -> tuple[int, int]:
        over.enqueue(TIMEOUT_TASKS)
        return min(p.trigger for p in over.planned), max(p.trigger for p in over.planned) + 6000

    load, start, end = load_then(cluster, 10, 2, enqueue_overrunning)
    ids = over.ids
    verdict = judge(cluster, "processor over its timeout_ms", over.planned + load.planned,
                    fault_start=start, fault_end=end, expect_failed=ids, retried_by_design=ids)
    rows = cluster.task_rows(ids)
    verdict.extra["over-timeout tasks: statuses"] = dict(cluster.status_of(ids))
    verdict.extra["over-timeout tasks: last_error"] = sorted({str(r.last_error)
                                                              for r in rows.values()})
    conclude(cluster, verdict)


# -- a wall-clock step on one scheduler --------------------------------------------------------

#: most lateness tolerated for tasks due after a clock step (the step itself is 10 s)
CLOCK_LATE_MS = 2000
#: a dead window longer than the step: a node whose heartbeats are written 10 s in the
#: past is not declared dead (and its tasks taken over) before its own lateness shows
CLOCK_ENV = {"heartbeat_misses": 15}

@pytest.fixture
def faketime(tmp_path: Path) -> Faketime:
    ft = Faketime(tmp_path)
    why = ft.unavailable()
    if why:
        pytest.skip(f"libfaketime unusable here: {why}")
    return ft


@pytest.mark.timeout(150)
@pytest.mark.parametrize("step_s", [10, -10], ids=["plus10s", "minus10s"])
def test_wall_clock_step_on_one_scheduler(cluster: Cluster, faketime: Faketime,
                                          step_s: int) -> None:
    """s1 runs under libfaketime (monotonic time not faked: an NTP step); its wall clock
    steps by ``step_s``. Early starts are judged from the workers' (unfaked) clocks."""
    cluster.env = {**cluster.env, **CLOCK_ENV}
    cluster.standard(scheduler_raw={"s1": faketime.env()})

    def step() -> tuple[int, int]:
        at = now_ms()
        faketime.step(step_s)
        return at, at + 1000

    load, start, end = load_then(cluster, 10, 3, step)
    verdict = judge(cluster, f"wall clock {step_s:+d} s on one scheduler", load.planned,
                    fault_start=start, fault_end=end)
    with contextlib.suppress(Exception):
        info = cluster.node_info("s1")
        verdict.extra["s1 clock_offset_ms (heartbeat)"] = info.get("clock_offset_ms")
    # "never early or late by more than the claim lead": 2 s leaves room for a busy host
    conclude(cluster, verdict, max_late_after_ms=CLOCK_LATE_MS)
