"""The fault-injection harness: a real cluster under a steady load, faults, and a judge.

* :class:`Cluster` — 2 ``ax-scheduler`` (``s0``, ``s1``) and 2 ``ax-worker`` (``w0``,
  ``w1``) subprocesses (:class:`tests.e2e.system.System` underneath), with short
  liveness settings (:data:`SHORT`) so a scenario takes seconds. A node can be
  SIGKILLed and started again under the same name; every pid it had is kept.
* :class:`Producer` — a thread enqueueing ``rate`` tasks/s for ``duration`` seconds
  through :class:`ax_kombu.api.Client`, each due ``lead`` seconds ahead (spread), with
  its planned trigger time in the payload.
* :class:`Ledger` — what the ``fault.task`` processor (:mod:`tests.faults.fault_tasks`)
  wrote: one start and one end line per run.
* :func:`judge` — after the load: waits (poll, deadline, early exit when nothing moves)
  until every task is final, then computes a :class:`Verdict` from the ledger and the
  table: lost, stuck, ran twice (and on which pid), published twice for one attempt,
  started early, max lateness during and after the fault, later tasks run exactly once.
  Every verdict is kept in :data:`RESULTS` for the session's summary table.
* :class:`TcpProxy` — 127.0.0.1:random → PostgreSQL; :meth:`TcpProxy.cut` closes every
  proxied connection and refuses new ones for N seconds (a failover, a restart).
* :class:`PrivateRedis`, :class:`PrivateRabbit` — servers of the test's own on free
  loopback ports, which a scenario may restart (the shared ones are never touched).
* :class:`Faketime` — libfaketime on one process, its wall clock stepped mid-run.

Times are epoch milliseconds of the test host (the database runs on the same clock).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.e2e.system import REPO, Daemon, System, _command, stop_all

TASKS_MODULE = "tests.faults.fault_tasks"
TASK_TYPE = "fault.task"
FINAL = ("SUCCESS", "FAILED", "CANCELLED")
#: how early a start may look because two clocks (worker, database) were read (ms)
EARLY_TOLERANCE_MS = 10

#: liveness and recovery settings for every daemon: a node is dead after 3 s of silence,
#: recovery runs every second, an unstarted dispatch is retried after 3 s
SHORT: dict[str, Any] = {
    "heartbeat_interval_s": 1, "heartbeat_misses": 3, "recovery_interval_s": 1,
    "ack_timeout_ms": 3000, "worker_grace_s": 3, "retry_backoff_base_ms": 200,
    "retry_backoff_max_ms": 2000, "retry_backoff_jitter": 0.5,
}
#: the dead-node window under SHORT (ms)
DEAD_WINDOW_MS = 3000
#: pools of each worker: one worker alone carries the steady load with room to spare
WORKER_POOLS = "high=8,default=8,slow=4"

#: every verdict of the session, for the summary table
RESULTS: list[Verdict] = []


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def poll(check: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """``check()`` until it is true or ``timeout`` s passed; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def terminate(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; always reaps."""
    stop_all([proc], grace_s)


# -- the cluster ------------------------------------------------------------------------------

@dataclass
class NodeSpec:
    kind: str
    args: list[str]
    ax: dict[str, Any]
    raw: dict[str, str]


class Cluster(System):
    """Schedulers and workers on one store and broker, each with the ledger in its
    environment; see the module docstring.

    Args (beyond :class:`System`'s):
        daemon_database_url: the store URL the daemons use (e.g. through a
            :class:`TcpProxy`); the test's own reads and the producer go direct.
    """

    def __init__(self, database_url: str, broker: Mapping[str, str], tmp: Path,
                 env: Mapping[str, Any] | None = None,
                 daemon_database_url: str | None = None) -> None:
        super().__init__(database_url, broker, tmp, {**SHORT, **(env or {})})
        self.daemon_database_url = daemon_database_url or database_url
        self.ledger = Ledger(tmp / "ledger.jsonl")
        self.specs: dict[str, NodeSpec] = {}
        #: every pid a node name had, in order
        self.pids: dict[str, list[int]] = defaultdict(list)
        #: pids killed with SIGKILL
        self.killed: set[int] = set()
        #: tasks the table showed RUNNING on a worker right after it was SIGKILLed
        self.running_at_kill: set[int] = set()

    def daemon_env(self, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
        env = super().daemon_env({"database_url": self.daemon_database_url, **(extra or {})})
        env["FAULT_LEDGER"] = str(self.ledger.path)
        return env

    def start(self, name: str, kind: str | None = None, args: Sequence[str] = (),
              ax: Mapping[str, Any] | None = None, raw: Mapping[str, str] | None = None
              ) -> Daemon:
        """Start node ``name`` (again, with its earlier kind and arguments if none given)."""
        if kind is None:
            spec = self.specs[name]
        else:
            spec = NodeSpec(kind, list(args), dict(ax or {}), dict(raw or {}))
            self.specs[name] = spec
        env = self.daemon_env(spec.ax)
        env["FAULT_NODE"] = name
        env.update(spec.raw)
        log = self.tmp / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen([*_command(spec.kind), "-n", name, "-l", "INFO", *spec.args],
                                    cwd=self.tmp, env=env, stdout=out, stderr=subprocess.STDOUT)
        daemon = Daemon(name, spec.kind, proc, log)
        self.daemons.append(daemon)
        self.pids[name].append(proc.pid)
        return daemon

    def scheduler(self, name: str, env: Mapping[str, Any] | None = None,
                  raw: Mapping[str, str] | None = None) -> Daemon:
        return self.start(name, "scheduler", ax=env, raw=raw)

    def worker(self, name: str, concurrency: str = WORKER_POOLS,
               args: Iterable[str] = (), env: Mapping[str, Any] | None = None,
               queues: str = "high,default,slow") -> Daemon:
        return self.start(name, "worker", ["-Q", queues, "-A", TASKS_MODULE, "-c", concurrency,
                                           *args], ax=env)

    def standard(self, queues: str = "high,default,slow",
                 scheduler_raw: Mapping[str, Mapping[str, str]] | None = None) -> None:
        """s0, s1, w0, w1, and wait until each registered."""
        for name in ("s0", "s1"):
            self.scheduler(name, raw=(scheduler_raw or {}).get(name))
        for name in ("w0", "w1"):
            self.worker(name, queues=queues)
        self.wait_registered(["s0", "s1", "w0", "w1"])

    def daemon(self, name: str) -> Daemon:
        """The latest process of node ``name``."""
        return [d for d in self.daemons if d.name == name][-1]

    def registered_pid(self, name: str) -> int | None:
        row = self.node(name)
        return None if row is None or row.stopped_at is not None else int(row.pid)

    def wait_registered(self, names: Iterable[str], timeout: float = 60.0) -> None:
        """Until each node's current process has written its node row."""
        names = list(names)
        self.wait_for(lambda: all(self.registered_pid(n) == self.daemon(n).proc.pid
                                  for n in names), timeout, f"{names} registered")

    def kill(self, daemon: Daemon) -> None:
        """SIGKILL, and wait until the process is gone."""
        self.killed.add(daemon.proc.pid)
        super().kill(daemon)

    def kill_node(self, name: str) -> int:
        """SIGKILL node ``name``'s process; returns the time (epoch ms).

        For a worker, what the table then says it was running (frozen: the process is
        gone) is added to :attr:`running_at_kill`: those tasks may run twice.
        """
        daemon = self.daemon(name)
        self.kill(daemon)
        at = now_ms()
        if daemon.kind == "worker":
            self.running_at_kill |= self.running_on(name)
        return at

    def running_pids(self) -> set[int]:
        return {d.proc.pid for d in self.daemons if d.alive}

    def close(self) -> None:
        stop_all([d.proc for d in self.daemons], grace_s=10)
        self.client.close()
        self.reader.dispose()

    # -- table reads beyond System's ------------------------------------------------------

    def task_rows(self, ids: Iterable[int] | None = None) -> dict[int, Any]:
        rows = {r.task_id: r for r in self.query(
            "SELECT task_id, status, attempt, retry_count, trigger_time, last_run_node, "
            "last_error, started_at, finished_at FROM ax_task")}
        if ids is None:
            return rows
        return {i: rows[i] for i in ids if i in rows}

    def status_of(self, ids: Iterable[int]) -> Counter[str]:
        rows = self.task_rows()
        return Counter(rows[i].status if i in rows else "MISSING" for i in ids)


# -- the ledger -------------------------------------------------------------------------------

@dataclass
class Run:
    """One processor run, as ``fault.task`` recorded it (``end`` None: never returned)."""

    task_id: int
    attempt: int
    retry: int
    trigger: int
    planned: int | None
    node: str
    pid: int
    start: int
    end: int | None = None

    def brief(self) -> str:
        ended = "never ended" if self.end is None else f"{self.end - self.start} ms"
        return f"attempt {self.attempt} on {self.node} pid {self.pid} at {self.start} ({ended})"


class Ledger:
    """The file every ``fault.task`` run appends to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        #: lines of the last read that did not parse
        self.corrupt: list[bytes] = []

    def lines(self) -> int:
        try:
            with open(self.path, "rb") as f:
                return sum(1 for _ in f)
        except FileNotFoundError:
            return 0

    def runs(self) -> list[Run]:
        """Every run so far. A last line still being written (no newline yet) is left for
        the next read; a line that does not parse is kept in :attr:`corrupt`."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        runs: list[Run] = []
        open_runs: dict[tuple[int, int, int], list[Run]] = defaultdict(list)
        self.corrupt = []
        for line in data.split(b"\n")[:-1]:
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except ValueError:
                self.corrupt.append(line)
                continue
            key = (d["id"], d["attempt"], d["pid"])
            if d["ev"] == "start":
                run = Run(d["id"], d["attempt"], d["retry"], d["trigger"], d.get("planned"),
                          d["node"], d["pid"], d["t"])
                runs.append(run)
                open_runs[key].append(run)
            elif open_runs[key]:
                open_runs[key].pop(0).end = d["t"]
        return runs

    def by_task(self) -> dict[int, list[Run]]:
        out: dict[int, list[Run]] = defaultdict(list)
        for run in self.runs():
            out[run.task_id].append(run)
        for runs in out.values():
            runs.sort(key=lambda r: r.start)
        return dict(out)


# -- the load ---------------------------------------------------------------------------------

@dataclass
class Planned:
    task_id: int
    enqueued: int
    trigger: int
    priority: str


class Producer:
    """``rate`` tasks/s for ``duration`` s in a thread, each due ``lead`` seconds ahead.

    Args:
        work: seconds of work (payload ``sleep``) of task number ``i``.
        options: more enqueue arguments for every task (priority is chosen round-robin
            from ``priorities`` unless given here).
    """

    def __init__(self, cluster: Cluster, rate: int = 100, duration: float = 12.0,
                 lead: tuple[float, float] = (1.0, 3.0),
                 priorities: Sequence[str] = ("high", "default"),
                 work: Callable[[int], float] | None = None,
                 options: Mapping[str, Any] | None = None, seed: int = 7,
                 tag: str = "load") -> None:
        self.cluster = cluster
        self.rate, self.duration, self.lead = rate, duration, lead
        self.priorities = list(priorities)
        self.work = work or default_work
        self.options = dict(options or {})
        self.random = random.Random(seed)
        self.tag = tag
        self.planned: list[Planned] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"producer-{tag}", daemon=True)
        self._count = 0

    def start(self) -> Producer:
        self.started = now_ms()
        self._thread.start()
        return self

    def items(self, n: int) -> list[tuple[dict[str, Any], int, str]]:
        out = []
        base = now_ms()
        for _ in range(n):
            i = self._count
            self._count += 1
            trigger = base + round(1000 * self.random.uniform(*self.lead))
            priority = self.options.get("priority") or self.priorities[i % len(self.priorities)]
            item = {"task_type": TASK_TYPE, "priority": priority,
                    "run_at": datetime.fromtimestamp(trigger / 1000, tz=UTC),
                    "payload": {"tag": self.tag, "i": i, "t": trigger, "sleep": self.work(i)},
                    **{k: v for k, v in self.options.items() if k != "priority"}}
            out.append((item, trigger, priority))
        return out

    def enqueue(self, n: int) -> list[int]:
        """Enqueue ``n`` tasks now (also usable without the thread)."""
        batch = self.items(n)
        enqueued = now_ms()
        ids = self.cluster.enqueue_many([item for item, _, _ in batch])
        self.planned += [Planned(task_id, enqueued, trigger, priority)
                         for task_id, (_, trigger, priority) in zip(ids, batch, strict=True)]
        return ids

    def _run(self) -> None:
        tick = 0.1
        per_tick = self.rate * tick
        owed = 0.0
        t0 = time.monotonic()
        while not self._stop.is_set() and time.monotonic() - t0 < self.duration:
            owed += per_tick
            n = int(owed)
            owed -= n
            if n:
                try:
                    self.enqueue(n)
                except Exception as exc:  # noqa: BLE001 - reported by the judge
                    self.errors.append(f"{type(exc).__name__}: {exc}")
            elapsed = time.monotonic() - t0
            self._stop.wait(max(0.0, tick - elapsed % tick))  # pacing, not a condition

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(self.duration + 30 if timeout is None else timeout)
        self.ended = now_ms()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    @property
    def ids(self) -> list[int]:
        return [p.task_id for p in self.planned]


def default_work(i: int) -> float:
    """Mostly 20–60 ms; every 10th task 0.5 s (so a worker is always mid-task)."""
    return 0.5 if i % 10 == 0 else 0.02 + (i % 5) * 0.01


# -- the judge --------------------------------------------------------------------------------

@dataclass
class Verdict:
    """What a fault did, judged from the ledger and the table."""

    fault: str
    tasks: int
    lost: list[int]
    never_ran: list[int]
    stuck: Counter[str]
    ran_twice: dict[int, list[Run]]
    #: of ran_twice: tasks RUNNING on a process when it was SIGKILLed (by the table right
    #: after the kill, or by a run of that process the ledger shows cut short)
    ran_twice_dead_pid: set[int]
    published_twice: list[tuple[int, int]]
    early: dict[int, int]
    late_before_ms: int | None
    late_during_ms: int | None
    late_after_ms: int | None
    later: int
    later_not_once: dict[int, int]
    overlapping: dict[int, list[Run]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    settled_s: float = 0.0
    #: a queue without consumer: most messages the broker held per task
    broker_per_task: float | None = None
    #: ledger lines that did not parse (the instrument failed: the verdict is void)
    ledger_corrupt: int = 0

    # -- presentation ----------------------------------------------------------------------

    def row(self) -> list[str]:
        def ms(v: int | None) -> str:
            return "-" if v is None else f"{v / 1000:.2f} s"
        twice = f"{len(self.ran_twice)}"
        if self.ran_twice_dead_pid:
            twice += f" ({len(self.ran_twice_dead_pid)} RUNNING on a killed pid)"
        stuck = ", ".join(f"{s} {n}" for s, n in sorted(self.stuck.items())) or "0"
        return [self.fault, str(self.tasks), str(len(self.lost)), stuck, twice,
                str(len(self.published_twice)), str(len(self.overlapping)), str(len(self.early)),
                ms(self.late_during_ms), ms(self.late_after_ms),
                f"{self.later - len(self.later_not_once)}/{self.later}",
                "-" if self.broker_per_task is None else f"{self.broker_per_task:.1f}"]

    def describe(self, limit: int = 8) -> str:
        lines = [f"fault: {self.fault}: {self.tasks} tasks, settled after {self.settled_s:.1f} s"]
        lines.append(f"  lost (not SUCCESS): {len(self.lost)}; never ran: {len(self.never_ran)}; "
                     f"not final: {dict(self.stuck)}")
        if self.ran_twice:
            lines.append(f"  ran twice: {len(self.ran_twice)} "
                         f"({len(self.ran_twice_dead_pid)} were RUNNING on a process that was "
                         f"killed)")
            for task_id, runs in list(self.ran_twice.items())[:limit]:
                lines.append(f"    {task_id}: " + "; ".join(r.brief() for r in runs))
        if self.published_twice:
            lines.append(f"  published twice for one attempt: {self.published_twice[:limit]}")
        if self.overlapping:
            lines.append(f"  two runs at once: {len(self.overlapping)}")
            for task_id, runs in list(self.overlapping.items())[:limit]:
                lines.append(f"    {task_id}: " + "; ".join(r.brief() for r in runs))
        if self.early:
            worst = sorted(self.early.items(), key=lambda kv: -kv[1])[:limit]
            lines.append(f"  started early: {len(self.early)}, ms early: {worst}")
        lines.append(f"  max lateness before / during / after the fault: "
                     f"{self.late_before_ms} / {self.late_during_ms} / {self.late_after_ms} ms")
        lines.append(f"  later tasks run exactly once: {self.later - len(self.later_not_once)}"
                     f" of {self.later}" + (f"; not once (runs): "
                                           f"{list(self.later_not_once.items())[:limit]}"
                                           if self.later_not_once else ""))
        lines += [f"  {k}: {v}" for k, v in self.extra.items()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    # -- invariants --------------------------------------------------------------------------

    def problems(self, *, allow_twice_on_killed_pid: bool = False,
                 max_late_after_ms: int | None = None) -> list[str]:
        """The issue's invariants this fault broke (empty: all held); lateness after the
        fault is judged only when ``max_late_after_ms`` is given."""
        found = []
        if self.ledger_corrupt:
            found.append(f"the ledger has {self.ledger_corrupt} unreadable lines")
        if self.lost:
            found.append(f"{len(self.lost)} of {self.tasks} tasks lost (not SUCCESS: "
                         f"{dict(self.stuck) or 'final but failed'}; {len(self.never_ran)} never "
                         f"ran)")
        allowed = self.ran_twice_dead_pid if allow_twice_on_killed_pid else set()
        unexplained = set(self.ran_twice) - allowed
        if unexplained:
            found.append(f"{len(unexplained)} tasks ran twice without having been RUNNING on a "
                         f"killed process, e.g. {sorted(unexplained)[:5]}")
        if self.published_twice:
            found.append(f"{len(self.published_twice)} (task, attempt) ran twice")
        if self.overlapping:
            found.append(f"{len(self.overlapping)} tasks had two runs at once")
        if self.early:
            found.append(f"{len(self.early)} tasks started before their trigger time "
                         f"(up to {max(self.early.values())} ms early)")
        if self.later_not_once:
            found.append(f"{len(self.later_not_once)} of {self.later} tasks enqueued after the "
                         f"fault did not run exactly once")
        if (max_late_after_ms is not None and self.late_after_ms is not None
                and self.late_after_ms > max_late_after_ms):
            found.append(f"tasks due after the fault ran up to {self.late_after_ms} ms late "
                         f"(> {max_late_after_ms} ms)")
        return found


def settle(cluster: Cluster, ids: Sequence[int], last_trigger: int, *, deadline_s: float = 25.0,
           stall_s: float = 8.0) -> float:
    """Wait until every task in ``ids`` is final and no run of a live process is still open.

    Gives up ``deadline_s`` after ``last_trigger``, or once nothing changed (statuses,
    ledger) for ``stall_s`` after the last trigger time passed. Returns the seconds waited.
    """
    t0 = time.monotonic()
    hard = time.monotonic() + max(0.0, (last_trigger - now_ms()) / 1000) + deadline_s
    wanted = set(ids)
    last_state: tuple[Any, ...] | None = None
    last_change = time.monotonic()
    while time.monotonic() < hard:
        rows = cluster.task_rows()
        statuses = Counter(rows[i].status if i in rows else "MISSING" for i in wanted)
        live = cluster.running_pids()
        runs = cluster.ledger.runs()
        open_runs = sum(1 for r in runs if r.end is None and r.pid in live)
        if sum(statuses[s] for s in FINAL) == len(wanted) and not open_runs:
            time.sleep(0.5)  # a last look for a late duplicate start
            return time.monotonic() - t0
        state = (tuple(sorted(statuses.items())), len(runs), open_runs)
        if state != last_state:
            last_state, last_change = state, time.monotonic()
        elif now_ms() > last_trigger and time.monotonic() - last_change > stall_s:
            break
        time.sleep(0.25)
    return time.monotonic() - t0


def judge(cluster: Cluster, fault: str, planned: Sequence[Planned], *, fault_start: int,
          fault_end: int, expect_failed: Iterable[int] = (), retried_by_design: Iterable[int] = (),
          deadline_s: float = 25.0, stall_s: float = 6.0) -> Verdict:
    """Wait for the tasks to settle (see :func:`settle`), then judge them.

    Args:
        planned: the tasks (as the producers enqueued them).
        fault_start, fault_end: the fault window (epoch ms); tasks planned inside it are
            "during", later ones "after"; tasks *enqueued* after ``fault_end`` are the
            "later tasks" that must run exactly once.
        expect_failed: tasks meant to end FAILED (not lost when they do).
        retried_by_design: tasks whose several runs are retries (not "ran twice"; two
            runs of them at once still count as overlapping).
    """
    ids = [p.task_id for p in planned]
    waited = settle(cluster, ids, max(p.trigger for p in planned), deadline_s=deadline_s,
                    stall_s=stall_s)
    rows = cluster.task_rows()
    by_task = cluster.ledger.by_task()
    corrupt = list(cluster.ledger.corrupt)
    expect_failed, retried_by_design = set(expect_failed), set(retried_by_design)

    lost, never_ran, stuck = [], [], Counter[str]()
    why_lost = Counter[str]()
    for task_id in ids:
        row = rows.get(task_id)
        status = row.status if row is not None else "MISSING"
        if status not in FINAL:
            stuck[status] += 1
        if status != "SUCCESS" and not (task_id in expect_failed and status == "FAILED"):
            lost.append(task_id)
            why_lost[f"{status}" + (f" ({row.last_error})" if row is not None
                                    and row.last_error else "")] += 1
        if task_id not in by_task:
            never_ran.append(task_id)

    ran_twice: dict[int, list[Run]] = {}
    dead_pid: set[int] = set()
    published_twice: list[tuple[int, int]] = []
    overlapping: dict[int, list[Run]] = {}
    early: dict[int, int] = {}
    for task_id in ids:
        runs = by_task.get(task_id, [])
        attempts = Counter(r.attempt for r in runs)
        published_twice += [(task_id, a) for a, n in attempts.items() if n > 1]
        if len(runs) > 1 and task_id not in retried_by_design:
            ran_twice[task_id] = runs
            if task_id in cluster.running_at_kill or any(
                    r.end is None and r.pid in cluster.killed for r in runs):
                dead_pid.add(task_id)
        for a, b in itertools.pairwise(runs):
            if (a.end is None and a.pid not in cluster.killed) or (a.end or 0) > b.start:
                overlapping[task_id] = runs
        for r in runs:
            if r.start < r.trigger - EARLY_TOLERANCE_MS:
                early[task_id] = max(early.get(task_id, 0), r.trigger - r.start)

    def late(select: Callable[[Planned], bool]) -> int | None:
        values = [by_task[p.task_id][0].start - p.trigger for p in planned
                  if select(p) and p.task_id in by_task]
        return max(values) if values else None

    later = [p.task_id for p in planned if p.enqueued >= fault_end]
    later_not_once = {t: len(by_task.get(t, [])) for t in later
                      if len(by_task.get(t, [])) != 1 and t not in retried_by_design}
    return Verdict(
        fault=fault, tasks=len(ids), lost=lost, never_ran=never_ran, stuck=stuck,
        ran_twice=ran_twice, ran_twice_dead_pid=dead_pid, published_twice=published_twice,
        early=early, late_before_ms=late(lambda p: p.trigger < fault_start),
        late_during_ms=late(lambda p: fault_start <= p.trigger <= fault_end),
        late_after_ms=late(lambda p: p.trigger > fault_end), later=len(later),
        later_not_once=later_not_once, overlapping=overlapping, settled_s=waited,
        extra={"lost by status (last_error)": dict(why_lost)} if why_lost else {},
        notes=[f"{len(corrupt)} unreadable ledger lines, e.g. {corrupt[:2]}"] if corrupt else [],
        ledger_corrupt=len(corrupt))


def record(verdict: Verdict) -> Verdict:
    """Keep ``verdict`` for the summary table, and print it."""
    RESULTS.append(verdict)
    print("\n" + verdict.describe())
    return verdict


def conclude(cluster: Cluster, verdict: Verdict, **invariants: Any) -> None:
    """Record the verdict, then fail the test with every broken invariant (and log tails)."""
    record(verdict)
    problems = verdict.problems(**invariants)
    assert not problems, ("; ".join(problems) + "\n" + verdict.describe() + "\n"
                          + cluster.tails(15))


HEADER = ["fault", "tasks", "lost", "stuck (not final)", "ran twice", "pub. twice / attempt",
          "2 runs at once", "early", "max late during", "max late after", "later ran once",
          "broker msgs / task"]


def table(verdicts: Sequence[Verdict]) -> str:
    """The summary table, as Markdown."""
    rows = [HEADER] + [v.row() for v in verdicts]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    fmt = [("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
           for r in rows]
    fmt.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(fmt)


# -- a TCP proxy that can cut the database off ------------------------------------------------

class TcpProxy:
    """127.0.0.1:``port`` → ``target``, one thread per direction of each connection.

    :meth:`cut` closes every proxied connection and refuses new ones (accepted and reset
    at once) for N seconds; then connections pass again.
    """

    def __init__(self, target: tuple[str, int] = ("127.0.0.1", 5432)) -> None:
        self.target = target
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(256)
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._refuse_until = 0.0
        self._closed = False
        self.refused = 0
        self.cut_connections = 0
        self._thread = threading.Thread(target=self._accept_loop, name="db-proxy", daemon=True)
        self._thread.start()

    def url(self, database_url: str) -> str:
        """``database_url`` with its host and port replaced by this proxy's."""
        from urllib.parse import urlsplit

        parts = urlsplit(database_url)
        user = parts.netloc.rpartition("@")[0]
        netloc = (user + "@" if user else "") + f"127.0.0.1:{self.port}"
        return parts._replace(netloc=netloc).geturl()

    @property
    def refusing(self) -> bool:
        return time.monotonic() < self._refuse_until

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refusing:
                self.refused += 1
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._sockets |= {client, upstream}
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._sockets.discard(src)
                self._sockets.discard(dst)

    def cut(self, seconds: float) -> None:
        """Close every proxied connection now and refuse new ones for ``seconds``."""
        self._refuse_until = time.monotonic() + seconds
        with self._lock:
            sockets = list(self._sockets)
            self._sockets.clear()
        self.cut_connections += len(sockets) // 2
        for s in sockets:
            _reset(s)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut(0)
        self._thread.join(5)


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (SO_LINGER 0), ignoring errors."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


# -- private servers the test may restart ------------------------------------------------------

def _wait_port(port: int, timeout: float) -> bool:
    def check() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            return False
        return True
    return bool(poll(check, timeout, 0.1))


class PrivateRedis:
    """A redis-server of the test's own on a free loopback port, without persistence
    (a restart loses whatever it held)."""

    def __init__(self, tmp: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found")
        self.binary, self.tmp, self.port = binary, tmp, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = open(self.tmp / "redis.log", "ab")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.tmp)], stdout=log, stderr=log)
        log.close()
        if not _wait_port(self.port, 15):
            raise RuntimeError(f"private redis-server did not listen on {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 10)
            self.proc = None


class PrivateRabbit:
    """A RabbitMQ node of the test's own (own node name, loopback ports, data dir and
    cookie), started from ``/usr/lib/rabbitmq/bin``; the shared server is never touched."""

    BIN = Path("/usr/lib/rabbitmq/bin")

    def __init__(self, tmp: Path) -> None:
        if not (self.BIN / "rabbitmq-server").exists():
            raise RuntimeError(f"{self.BIN}/rabbitmq-server not found")
        self.tmp = tmp
        self.port, self.dist_port = free_port(), free_port()
        self.node = f"axfault{os.getpid()}x{self.port}@localhost"
        (tmp / "rabbit.conf").write_text(f"listeners.tcp.local = 127.0.0.1:{self.port}\n"
                                         "loopback_users.guest = true\n")
        (tmp / "plugins").write_text("[].\n")
        self.env = {**os.environ, "HOME": str(tmp), "RABBITMQ_NODENAME": self.node,
                    "RABBITMQ_CONF_ENV_FILE": "/dev/null",
                    "RABBITMQ_CONFIG_FILE": str(tmp / "rabbit.conf"),
                    "RABBITMQ_MNESIA_BASE": str(tmp / "mnesia"),
                    "RABBITMQ_LOG_BASE": str(tmp / "rabbit-log"),
                    "RABBITMQ_ENABLED_PLUGINS_FILE": str(tmp / "plugins"),
                    "RABBITMQ_DIST_PORT": str(self.dist_port),
                    "RABBITMQ_PID_FILE": str(tmp / "rabbit.pid"),
                    "ERL_EPMD_ADDRESS": "127.0.0.1",
                    "ERL_FLAGS": "-kernel inet_dist_use_interface {127,0,0,1}"}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self, timeout: float = 60) -> None:
        log = open(self.tmp / "rabbit.out", "ab")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen([str(self.BIN / "rabbitmq-server")], env=self.env,
                                     stdout=log, stderr=log, start_new_session=True)
        log.close()
        if not _wait_port(self.port, timeout):
            raise RuntimeError(f"private RabbitMQ did not listen on {self.port} within "
                               f"{timeout:g} s")

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.BIN / "rabbitmqctl"), "-n", self.node, *args],
                              env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=False)

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.ctl("stop", timeout=30)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None


# -- libfaketime ------------------------------------------------------------------------------

FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")

SITECUSTOMIZE = '''\
"""Loaded by a process under libfaketime: with FAKETIME_DONT_FAKE_MONOTONIC=1,
time.sleep fails with EINVAL, so it sleeps in select() on the monotonic clock."""
import select
import time


def _sleep(seconds):
    deadline = time.monotonic() + seconds
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        select.select([], [], [], remaining)


time.sleep = _sleep
'''


class Faketime:
    """The environment that puts one process under libfaketime, and the clock step.

    The process's wall clock is the real one plus what the timestamp file says
    (``+0`` at first); :meth:`step` rewrites it. Monotonic time is not faked (as in
    an NTP step).
    """

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp / "faketime"
        self.dir.mkdir(exist_ok=True)
        self.file = self.dir / "offset"
        self._write("+0")
        (self.dir / "sitecustomize.py").write_text(SITECUSTOMIZE)

    def _write(self, value: str) -> None:
        tmp = self.file.with_suffix(".new")
        tmp.write_text(value + "\n")
        tmp.replace(self.file)

    def env(self, base_pythonpath: str = "") -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(self.dir), str(REPO), base_pythonpath) if p)
        return {"LD_PRELOAD": str(FAKETIME_LIB), "FAKETIME_TIMESTAMP_FILE": str(self.file),
                "FAKETIME_NO_CACHE": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1",
                "PYTHONPATH": path}

    def step(self, seconds: int) -> None:
        self._write(f"{seconds:+d}s")

    def unavailable(self) -> str | None:
        """None if a Python process under libfaketime sees a stepped clock and can sleep,
        else why not."""
        import sys

        if not FAKETIME_LIB.exists():
            return f"{FAKETIME_LIB} not found (Debian package 'faketime')"
        probe = self.dir / "probe"
        probe.write_text("+10s\n")
        env = {**os.environ, **self.env(), "FAKETIME_TIMESTAMP_FILE": str(probe)}
        code = "import time; t = time.time(); time.sleep(0.01); print(t)"
        try:
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                  text=True, timeout=30, check=False)
        except subprocess.TimeoutExpired:
            return "a Python process under libfaketime hung"
        if done.returncode != 0:
            return f"a Python process under libfaketime failed: {done.stderr.strip()[-300:]}"
        shift = float(done.stdout.strip()) - time.time()
        if not 8 < shift < 12:
            return f"libfaketime did not step the clock (+10 s asked, {shift:+.1f} s seen)"
        return None
