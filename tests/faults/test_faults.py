"""Fault injection under a steady load (issue 10): real processes, real signals, loopback only.

Each test starts 2 schedulers and 2 workers (``s0 s1 w0 w1``) on PostgreSQL + Redis
(or a private RabbitMQ), runs a steady producer, injects one fault, and judges from
the ledger and the table (see :mod:`tests.faults.judge`): every task final, none
lost, none run twice (except tasks RUNNING on a SIGKILLed process, each counted and
printed), none published twice for one attempt, no two runs of a task at once, none
started early, tasks enqueued after the fault run exactly once; after a clock step,
tasks due after it are on time too. Lateness is otherwise reported, not asserted.

A queue without consumer is tested at the integration tier, with a short ack timeout
(tests/integration/test_queue_without_consumer.py).

Run: ``.venv/bin/pytest tests/faults -p no:cacheprovider -q`` (the summary table is
printed at the end; see docs/reliability.md for today's figures).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ..services import serving, unavailable
from ..waiting import wait_until
from .cluster import DEAD_WINDOW_MS, Cluster
from .faketime import Faketime
from .judge import conclude, judge
from .producer import Producer
from .proxy import TcpProxy
from .servers import PrivateRabbit, PrivateRedis
from .timing import now_ms

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
        reached = wait_until(lambda: time.monotonic() - t0 >= fault_after
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
    return bool(wait_until(busy, timeout, 0.02))


def logged(daemon_log: Path, message: str, field: str) -> list[int]:
    """The ``field=N`` values of the lines of a daemon's log that contain ``message``."""
    try:
        lines = daemon_log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [int(m.group(1)) for line in lines if message in line
            and (m := re.search(rf"\b{field}=(\d+)", line))]



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
    assert cluster.running_at_kill, "w0 was killed while running nothing"
    recovered_elsewhere(cluster, "w0", cluster.killed)


def recovered_elsewhere(cluster: Cluster, name: str, pids: set[int]) -> None:
    """After node ``name``'s processes ``pids`` were SIGKILLed: what the table said it was
    running then ran again at a new attempt, on another node; a run the kill cut short
    (started, never ended, by the ledger) counts one retry and leaves "worker lost" as its
    last error; a retry is counted only for a task the recovery took from the dead node
    (a LOST attempt in its history), never more than one. Whether a staged run counts one
    depends on whether its worker had listed it (tests/faults/test_listed_runs.py judges
    that exactly); the table is read after the kill, so a RUNNING move the dead process
    sent just before it may commit after that read."""
    rows = cluster.task_rows()
    for task_id in cluster.running_at_kill:
        row = rows[task_id]
        assert row.attempt >= 2 and row.owner_node != name, row
    cut = {r.task_id for r in cluster.ledger.runs() if r.pid in pids and r.end is None}
    assert cut, "the kill cut no run short"
    wrong = {t: (rows[t].retry_count, rows[t].last_error) for t in cut
             if (rows[t].retry_count, rows[t].last_error) != (1, "worker lost")}
    assert not wrong, f"runs cut short by the kill, not counted one retry: {wrong}"
    lost = {r.task_id for r in cluster.query(
        "SELECT DISTINCT task_id FROM ax_attempt WHERE outcome = 'LOST'")}
    retried = {t: r.retry_count for t, r in rows.items() if r.retry_count}
    assert set(retried) <= lost and set(retried.values()) <= {1}, (
        f"retries the kill does not explain: {retried}, LOST: {sorted(lost)}")


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


# -- the database ------------------------------------------------------------------------------

def cut_database(cluster: Cluster, proxy: TcpProxy, seconds: float) -> Callable[[],
                                                                                 tuple[int, int]]:
    def cut() -> tuple[int, int]:
        at = now_ms()
        proxy.cut(seconds)
        back = wait_until(lambda: not proxy.refusing, seconds + 5, 0.1)
        assert back
        return at, now_ms()
    return cut


#: a database cut well past the silence window (DEAD_WINDOW_MS) and the ack timeout: every
#: node's lease runs out and none may judge another dead until its own heartbeats succeed
#: again; a longer cut adds seconds, not cases (the lease and the beats run on the monotonic
#: clock, and nothing else times out during a cut)
CUT_S = 8


@pytest.mark.timeout(150)
def test_database_cut_past_the_silence_window(proxied_cluster: Cluster,
                                              proxy: TcpProxy) -> None:
    cluster = proxied_cluster
    cluster.standard()
    load, start, end = load_then(cluster, CUT_S + 6, 3, cut_database(cluster, proxy, CUT_S))
    verdict = judge(cluster, f"database cut {CUT_S} s (proxy)", load.planned,
                    fault_start=start, fault_end=end + 2000)
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
    messages it kept are gone; the ack timeout must dispatch those tasks again."""
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
