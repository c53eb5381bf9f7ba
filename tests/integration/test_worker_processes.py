"""``ax-worker --processes 2``: one supervisor, two worker processes, real signals.

Each test runs one ``ax-scheduler`` and one supervisor (``-n wp``, children
``wp.1`` and ``wp.2``) as real processes on this run's PostgreSQL database and
its own Redis key prefix (:class:`tests.e2e.system.System`). Processors append
one line per run, with their pid, to a run log (:mod:`tests.e2e.e2e_tasks`),
so the tests count runs and see which process ran what. Every wait is a poll
with a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ax_kombu.cli.worker import worker_processes
from ax_kombu.config import from_env
from ax_kombu.store.nodes import pid_running
from ax_kombu.worker.supervisor import child_name, restart_delay_s

from ..e2e.system import Daemon, System
from ..ledger import Ledger
from ..waiting import wait_until


def services(test: Callable[..., None]) -> Callable[..., None]:
    """Marks a test that runs real daemons on PostgreSQL and Redis."""
    for mark in (pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(90)):
        test = mark(test)
    return test


NAME = "wp"
CHILDREN = (child_name(NAME, 1), child_name(NAME, 2))
POOLS = "high=2,default=2,slow=2"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def make_system(pg_url: str, redis_broker: dict[str, str],
                tmp_path: Path) -> Iterator[Callable[..., System]]:
    """``make_system(**settings)``: a System whose daemons get these settings too."""
    made: list[System] = []

    def make(**env: Any) -> System:
        system = System(pg_url, redis_broker, tmp_path,
                        env={"retry_backoff_base_ms": 200, "retry_backoff_max_ms": 1000, **env})
        made.append(system)
        return system

    yield make
    for system in made:
        system.close()


def start(system: System, *args: str) -> Daemon:
    """A scheduler and ``ax-worker --processes 2 -n wp``; returns the supervisor once both
    children and the scheduler are registered."""
    system.scheduler("sched-0")
    supervisor = system.worker(NAME, concurrency=POOLS, args=["--processes", "2", *args])
    system.wait_for(lambda: {"sched-0", *CHILDREN} <= system.live_nodes(), 60,
                    "the scheduler and both worker processes registered")
    return supervisor


def pid_of(system: System, node: str) -> int:
    return int(system.node(node).pid)


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def assert_stopped_cleanly(supervisor: Daemon) -> None:
    """Each child's exit, as the supervisor logged it, was a plain ``exit 0``."""
    tail = supervisor.tail(400)
    exits = [line for line in tail.splitlines() if "worker process exited node=" in line]
    assert len(exits) == len(CHILDREN) and all("status=exit 0" in line for line in exits), tail
    assert "Fatal Python error" not in tail and "Traceback" not in tail, tail


def two_children(make_system: Callable[..., System], tmp_path: Path
                 ) -> tuple[System, Ledger, Daemon, set[int]]:
    """A system, its run log, a supervisor of two children started on it, the children's pids."""
    system = make_system()
    supervisor = start(system)
    return (system, Ledger(tmp_path / "runs.jsonl"), supervisor,
            {pid_of(system, name) for name in CHILDREN})


def items(log: Ledger, count: int, **payload: Any) -> list[dict[str, Any]]:
    return [{"task_type": "e2e.task", "payload": {"log": str(log), "i": i, **payload},
             "delay": 1.0, "max_retry": 3} for i in range(count)]


@services
def test_two_processes_run_a_batch_exactly_once_between_them(
        make_system: Callable[..., System], tmp_path: Path) -> None:
    system, log, supervisor, pids = two_children(make_system, tmp_path)
    assert len(pids) == 2 and supervisor.proc.pid not in pids
    assert {parent_of(pid) for pid in pids} == {supervisor.proc.pid}

    ids = system.enqueue_many(items(log, 40, sleep=0.05))
    system.wait_final(len(ids), 40)

    rows = system.tasks()
    assert {r.status for r in rows.values()} == {"SUCCESS"}
    runs = log.by_task()
    assert sorted(runs) == sorted(ids)
    assert all(len(task_runs) == 1 for task_runs in runs.values()), runs
    assert {run.pid for task_runs in runs.values() for run in task_runs} == pids
    assert {r.owner_node for r in rows.values()} == set(CHILDREN)


@services
def test_sigterm_to_the_supervisor_stops_every_child_warmly(
        make_system: Callable[..., System], tmp_path: Path) -> None:
    system, log, supervisor, pids = two_children(make_system, tmp_path)
    ids = system.enqueue_many(items(log, 4, sleep=1.5))
    system.wait_for(lambda: len({r.pid for r in log.runs()}) == 2 and len(log.runs()) == 4, 30,
                    "two runs started in each process", detail=log.runs)

    supervisor.proc.send_signal(signal.SIGTERM)
    assert supervisor.proc.wait(30) == 0, system.tails()

    assert not any(pid_running(pid) for pid in pids)
    rows = system.tasks()
    assert {rows[i].status for i in ids} == {"SUCCESS"}, "warm: running tasks finish"
    assert all(len(r) == 1 for r in log.by_task().values())
    assert not system.query("SELECT task_id FROM ax_task WHERE status = 'RUNNING'")
    for name in CHILDREN:
        assert system.node(name).stopped_at is not None, f"{name} did not stop cleanly"
    assert "stopping the worker processes" in supervisor.tail(200)
    assert_stopped_cleanly(supervisor)


@services
def test_a_killed_child_is_restarted_under_its_name_and_every_task_runs(
        make_system: Callable[..., System], tmp_path: Path) -> None:
    system = make_system(ack_timeout_ms=3000)
    log = Ledger(tmp_path / "runs.jsonl")
    supervisor = start(system)
    victim = CHILDREN[0]
    victim_pid = pid_of(system, victim)
    ids = system.enqueue_many(items(log, 12, sleep=1.0))
    system.wait_for(lambda: any(r.pid == victim_pid for r in log.runs()), 30,
                    f"{victim} running a task")
    incarnation = system.node(victim).incarnation

    os.kill(victim_pid, signal.SIGKILL)

    def restarted() -> bool:
        row = system.node(victim)
        return bool(row.pid != victim_pid and row.stopped_at is None
                    and row.incarnation > incarnation)

    system.wait_for(restarted, 30, f"{victim} restarted and registered")
    new_pid = pid_of(system, victim)
    assert parent_of(new_pid) == supervisor.proc.pid
    system.wait_final(len(ids), 60)

    rows = system.tasks()
    assert {rows[i].status for i in ids} == {"SUCCESS"}
    runs = log.by_task()
    assert sorted(runs) == sorted(ids)
    # what the killed process was running ran again, in another process, at a new attempt
    again = [task_runs for task_runs in runs.values()
             if task_runs[0].pid == victim_pid and len(task_runs) > 1]
    assert again, runs
    assert all(r.pid != victim_pid for task_runs in again for r in task_runs[1:]), again
    assert supervisor.alive
    tail = supervisor.tail(400)
    assert "worker process exited unexpectedly; restarting it" in tail
    assert "SIGKILL" in tail


def scrape(port: int) -> Samples | None:
    """Every sample of the endpoint, by (name, labels); None if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            body = response.read().decode()
    except OSError:
        return None
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def total(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@services
def test_one_endpoint_sums_the_children_metrics(
        make_system: Callable[..., System], tmp_path: Path) -> None:
    system = make_system()
    log = Ledger(tmp_path / "runs.jsonl")
    port = free_port()
    supervisor = start(system, "--metrics-port", str(port))
    pids = [pid_of(system, name) for name in CHILDREN]
    with open(f"/proc/{pids[0]}/environ", "rb") as environ:
        variables = dict(v.split(b"=", 1) for v in environ.read().split(b"\0") if b"=" in v)
    shared_dir = Path(variables[b"PROMETHEUS_MULTIPROC_DIR"].decode())
    assert shared_dir.is_dir()

    def settled(check: Callable[[Samples], bool], what: str) -> Samples:
        last: list[Samples | None] = [None]

        def attempt() -> Samples | None:
            last[0] = scrape(port)
            return last[0] if last[0] is not None and check(last[0]) else None

        return system.wait_for(attempt, 20, what, detail=lambda: last[0])  # type: ignore[no-any-return]

    def both_up(s: Samples) -> bool:
        return (total(s, "ax_node_up", kind="worker") == 2
                and total(s, "ax_pool_size", queue="default") == 4)

    settled(both_up, "both children up, their pools summed")
    ids = system.enqueue_many(items(log, 30))
    system.wait_final(len(ids), 40)
    ran = len(log.runs())
    assert ran == len(ids)
    samples = settled(lambda s: total(s, "ax_execute_total") >= ran, "the counters caught up")
    assert total(samples, "ax_execute_total") == ran
    assert total(samples, "ax_execute_total", result="success") == ran
    assert total(samples, "ax_execute_duration_seconds_count") == ran
    assert not any("pid" in dict(ls) for (n, ls) in samples if n == "ax_execute_total")

    # a dead child's counts stay in the sums; its live gauges go, its successor's come
    os.kill(pids[0], signal.SIGKILL)
    system.wait_for(lambda: pid_of(system, CHILDREN[0]) != pids[0], 30, "the child restarted")
    samples = settled(both_up, "the restarted child counted once in the gauges")
    assert total(samples, "ax_execute_total") == ran

    supervisor.proc.send_signal(signal.SIGTERM)
    assert supervisor.proc.wait(30) == 0, system.tails()
    assert not shared_dir.exists(), "the supervisor removes the metrics directory"
    assert_stopped_cleanly(supervisor)


@services
def test_by_default_a_worker_runs_one_process_per_core(
        make_system: Callable[..., System], tmp_path: Path) -> None:
    """``--processes auto``, the user's default (this suite sets 1 for its other workers)."""
    cores = len(os.sched_getaffinity(0))
    system = make_system()
    system.scheduler("sched-0")
    worker = system.worker(NAME, concurrency=POOLS, env={"worker_processes": "auto"})
    names = {child_name(NAME, i) for i in range(1, cores + 1)} if cores > 1 else {NAME}
    system.wait_for(lambda: names <= system.live_nodes(), 60,
                    f"{len(names)} worker process(es) registered")
    assert system.live_nodes() == {"sched-0", *names}
    log = Ledger(tmp_path / "runs.jsonl")
    system.enqueue_many(items(log, 20))
    system.wait_final(20, 60)
    runs = log.by_task()
    assert len(runs) == 20 and all(len(task_runs) == 1 for task_runs in runs.values()), runs
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(30) == 0, system.tails()


def test_auto_is_one_process_per_core_and_one_on_sqlite() -> None:
    pg = from_env({}, database_url="postgresql://h/db")
    assert worker_processes(pg, cores=4) == 4
    assert worker_processes(pg, cores=1) == 1
    assert worker_processes(from_env({}, database_url="sqlite:///ax.db"), cores=4) == 1


@pytest.mark.parametrize("given", ["flag", "variable"])
def test_zero_processes_is_a_usage_error(tmp_path: Path, given: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AX_")}
    args = ["--processes", "0"] if given == "flag" else []
    if given == "variable":
        env["AX_WORKER_PROCESSES"] = "0"
    done = subprocess.run([sys.executable, "-m", "ax_kombu.cli.worker", *args], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("ax: error: ") and "'--processes'" in lines[0], lines
    assert "0 is not in the range x>=1" in lines[0], lines


def test_restart_back_off_doubles_up_to_its_cap() -> None:
    assert [restart_delay_s(n) for n in range(8)] == [1.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_children_repeat_the_flags_given_less_the_supervisors_own() -> None:
    from ax_kombu.cli.worker import child_argv, main

    ctx = main.make_context("ax-worker", [
        "-Q", "high,slow", "-A", "app.one", "-A", "app.two", "-c", "4", "-n", "w1",
        "--processes", "3", "--pidfile", "/tmp/w.pid", "--metrics-port", "9100",
        "-l", "debug", "--db", "sqlite:///ax.db"])
    # --db goes to the children by environment (child_env), never in an argv `ps` shows
    assert child_argv(ctx) == ["--queues", "high,slow", "--app", "app.one", "--app", "app.two",
                               "--concurrency", "4", "--loglevel", "DEBUG"]


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_a_second_signal_stops_every_child_cold(tmp_path: Path) -> None:
    """On the embedded store and transport (no servers): SIGTERM then SIGQUIT to the
    supervisor → each child stops cold (exit 1), and so does the supervisor."""
    from ax_kombu.config import from_env
    from ax_kombu.store import Store

    from ..e2e.system import stop_all

    url = f"sqlite:///{tmp_path / 'ax.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AX_")}
    env.update({"AX_DATABASE_URL": url, "AX_BROKER_URL": f"ax+sqlite:///{tmp_path / 'b.db'}",
                "AX_HEARTBEAT_INTERVAL_S": "0.5"})
    with open(tmp_path / "wc.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ax_kombu.cli.worker", "-n", "wc",
                                 "--processes", "2", "-l", "INFO"], env=env, cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT)
    store = Store(from_env({}, database_url=url))
    try:
        def registered() -> bool:
            with store.engine.connect() as conn:
                rows = conn.exec_driver_sql(
                    "SELECT node_id FROM ax_node WHERE stopped_at IS NULL").fetchall()
            return {r[0] for r in rows} >= {"wc.1", "wc.2"}

        wait_until(lambda: registered() or proc.poll() is not None, 40)
        assert registered() and proc.poll() is None, (tmp_path / "wc.log").read_text()
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGQUIT)
        assert proc.wait(30) == 1
    finally:
        stop_all([proc])
        store.close()
    lines = (tmp_path / "wc.log").read_text().splitlines()
    exits = [line for line in lines if "worker process exited node=" in line]
    assert len(exits) == 2 and all("status=exit 1" in line for line in exits), lines
    assert any("stopping the worker processes cold=True" in line for line in lines), lines


@services
def test_the_children_get_the_urls_by_environment_not_on_their_command_line(
        make_system: Callable[..., System], tmp_path: Path) -> None:
    """``--db`` and ``--broker`` given to the supervisor reach each child as
    ``AX_DATABASE_URL`` / ``AX_BROKER_URL`` in its environment, never on its argv (which
    ``ps`` shows every user); the children connect with them: the supervisor's own
    ``AX_*`` URLs point nowhere."""
    system = make_system()
    db, broker = system.database_url, system.settings.broker_url
    nowhere = {"database_url": "postgresql://nobody:hunter2@127.0.0.1:9/none",
               "broker_url": "redis://:hunter2@127.0.0.1:9/0"}
    system.scheduler("sched-0")
    system.worker(NAME, concurrency=POOLS, env=nowhere,
                  args=["--processes", "2", "--db", db, "--broker", broker])
    system.wait_for(lambda: {"sched-0", *CHILDREN} <= system.live_nodes(), 60,
                    "the scheduler and both worker processes registered")
    for name in CHILDREN:
        pid = pid_of(system, name)
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert not [arg for arg in argv if b"://" in arg or b"hunter2" in arg], argv
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"AX_DATABASE_URL={db}".encode() in environ
        assert f"AX_BROKER_URL={broker}".encode() in environ
    log = Ledger(tmp_path / "runs.jsonl")
    ids = system.enqueue_many(items(log, 6, sleep=0.01))
    system.wait_final(len(ids), 30)
    assert {r.status for r in system.tasks().values()} == {"SUCCESS"}
