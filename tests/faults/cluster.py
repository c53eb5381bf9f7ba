"""The cluster under test: 2 ``ax-scheduler`` (``s0``, ``s1``) and 2 ``ax-worker`` (``w0``,
``w1``) subprocesses (:class:`tests.e2e.system.System` underneath), with short liveness
settings (:data:`SHORT`) so a scenario takes seconds.

A node can be SIGKILLed and started again under the same name; every pid it had is kept,
and so is what the table said a killed worker was running (those tasks may run twice).
Each daemon finds the :class:`~tests.ledger.Ledger` file in its environment
(``FAULT_LEDGER``) and its node name in ``FAULT_NODE``.
"""

from __future__ import annotations

import subprocess
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.e2e.system import Daemon, System, _command, stop_all

from ..ledger import Ledger
from .timing import now_ms

TASKS_MODULE = "tests.faults.fault_tasks"

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
            :class:`~tests.faults.proxy.TcpProxy`); the test's own reads and the producer
            go direct.
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
            "SELECT task_id, status, attempt, retry_count, trigger_time, owner_node, "
            "last_error, started_at, finished_at FROM ax_task")}
        if ids is None:
            return rows
        return {i: rows[i] for i in ids if i in rows}

    def status_of(self, ids: Iterable[int]) -> Counter[str]:
        rows = self.task_rows()
        return Counter(rows[i].status if i in rows else "MISSING" for i in ids)
