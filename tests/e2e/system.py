"""A whole ax system in real processes, for the end-to-end tests.

:class:`System` starts ``ax-scheduler`` and ``ax-worker`` as subprocesses on
one store and one broker (settings passed as ``AX_*`` variables, exactly as an
operator would), sends them real signals, and lets the test enqueue tasks and
read the ``ax_task`` table. Each daemon's output goes to a log file in the
test's temporary directory; :meth:`System.wait_for` and :meth:`System.tails`
put the end of every log into an assertion message.

What the processors of :mod:`tests.e2e.e2e_tasks` ran is read from their run ledger
(:class:`tests.ledger.Ledger`).

:func:`module_cluster` holds one :class:`System` for a whole test module, on this run's
PostgreSQL database and Redis queues and a key prefix of its own, and cleans both up after.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, text

from ax_kombu.api import Client
from ax_kombu.config import from_env
from ax_kombu.store.engine import make_engine

from ..services import delete_redis_keys, own_redis_broker
from ..waiting import wait_until

#: the repository root: the workers import ``tests.e2e.e2e_tasks`` from it
REPO = Path(__file__).resolve().parents[2]
TASKS_MODULE = "tests.e2e.e2e_tasks"
#: how early a start may look because two clocks were read (ms)
CLOCK_TOLERANCE_MS = 5
FINAL = ("SUCCESS", "FAILED", "CANCELLED")


def stop_all(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 30.0) -> None:
    """SIGTERM each process still running, wait up to ``grace_s`` for each, SIGKILL the rest."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass
class Daemon:
    """One running ax process."""

    name: str
    kind: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 25) -> str:
        try:
            text_ = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text_.splitlines()[-lines:])


def _command(kind: str) -> list[str]:
    """The installed ``ax-scheduler`` / ``ax-worker`` next to this interpreter, else the
    same entry point through ``python -c``."""
    script = Path(sys.executable).parent / f"ax-{kind}"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", f"from ax_kombu.cli.{kind} import main; main()"]


@dataclass
class System:
    """Schedulers and workers on one store and broker; see the module docstring.

    Args:
        database_url: the store (the test's PostgreSQL database or a SQLite file).
        broker: settings of the broker fixtures (``broker_url``, queue names, key prefix).
        tmp: where logs and run logs go.
        env: more ``AX_*`` settings for every daemon (names without the prefix, any case).
    """

    database_url: str
    broker: Mapping[str, str]
    tmp: Path
    env: Mapping[str, Any] = field(default_factory=dict)
    daemons: list[Daemon] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.settings = from_env({}, database_url=self.database_url, **self.broker)
        self.client = Client(self.settings)
        self.reader: Engine = (create_engine(self.database_url)  # plain reads: no write lock
                               if self.database_url.startswith("sqlite")
                               else make_engine(self.database_url))

    # -- processes -------------------------------------------------------------------------

    def daemon_env(self, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AX_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        settings = {"database_url": self.database_url, **self.broker, "worker_processes": 1,
                    "heartbeat_interval_s": 0.5, "heartbeat_misses": 3,
                    "recovery_interval_s": 1, "ack_timeout_ms": 15000, "worker_grace_s": 15,
                    **self.env, **(extra or {})}
        env.update({f"AX_{k.upper()}": str(v) for k, v in settings.items()})
        return env

    def _start(self, kind: str, name: str, args: list[str],
               env: Mapping[str, Any] | None) -> Daemon:
        log = self.tmp / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen([*_command(kind), "-n", name, "-l", "INFO", *args],
                                    cwd=self.tmp, env=self.daemon_env(env), stdout=out,
                                    stderr=subprocess.STDOUT)
        daemon = Daemon(name, kind, proc, log)
        self.daemons.append(daemon)
        return daemon

    def scheduler(self, name: str, env: Mapping[str, Any] | None = None) -> Daemon:
        return self._start("scheduler", name, [], env)

    def worker(self, name: str, concurrency: str = "high=8,default=8,slow=4",
               args: Iterable[str] = (), env: Mapping[str, Any] | None = None) -> Daemon:
        return self._start("worker", name, ["-Q", "high,default,slow", "-A", TASKS_MODULE,
                                            "-c", concurrency, *args], env)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until every started daemon has registered its heartbeat."""
        names = {d.name for d in self.daemons if d.alive}
        self.wait_for(lambda: names <= self.live_nodes(), timeout,
                      f"daemons {sorted(names)} registered")

    def signal(self, daemon: Daemon, sig: int) -> None:
        daemon.proc.send_signal(sig)

    def kill(self, daemon: Daemon) -> None:
        """SIGKILL, and wait until the process is gone."""
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(10)

    def close(self) -> None:
        """Warm-stop what still runs (SIGKILL if it does not exit), release the client."""
        stop_all([daemon.proc for daemon in self.daemons])
        self.client.close()
        self.reader.dispose()

    def tails(self, lines: int = 25) -> str:
        return "\n".join(f"--- {d.name} ({'running' if d.alive else f'exit {d.proc.returncode}'})"
                         f" {d.log}\n{d.tail(lines)}" for d in self.daemons)

    # -- waiting ---------------------------------------------------------------------------

    def wait_for(self, check: Callable[[], Any], timeout: float, what: str,
                 detail: Callable[[], Any] | None = None) -> Any:
        """Poll ``check`` until it returns something true; fail with the logs otherwise."""
        value = wait_until(check, timeout)
        if not value:
            raise AssertionError(f"{what}: not reached within {timeout:g}s"
                                 f"{'; ' + str(detail()) if detail else ''}\n{self.tails()}")
        return value

    def wait_final(self, count: int, timeout: float) -> None:
        """Until ``count`` tasks are SUCCESS, FAILED or CANCELLED."""
        self.wait_for(lambda: sum(self.statuses()[s] for s in FINAL) >= count, timeout,
                      f"{count} tasks finished", detail=self.statuses)

    # -- the store -------------------------------------------------------------------------

    def enqueue_many(self, items: list[dict[str, Any]]) -> list[int]:
        return [int(i) for i in self.client.enqueue_many(items)]

    def query(self, sql: str, **params: Any) -> list[Any]:
        with self.reader.connect() as conn:
            return list(conn.execute(text(sql), params))

    def statuses(self) -> Counter[str]:
        return Counter({r[0]: r[1] for r in self.query(
            "SELECT status, COUNT(*) FROM ax_task GROUP BY status")})

    def tasks(self) -> dict[int, Any]:
        """Every task row, by id."""
        return {r.task_id: r for r in self.query("SELECT * FROM ax_task")}

    def running_on(self, node: str) -> set[int]:
        return {r[0] for r in self.query(
            "SELECT task_id FROM ax_task WHERE status = 'RUNNING' AND owner_node = :n", n=node)}

    def live_nodes(self) -> set[str]:
        return {r[0] for r in self.query("SELECT node_id FROM ax_node WHERE stopped_at IS NULL")}

    def node(self, name: str) -> Any:
        rows = self.query("SELECT * FROM ax_node WHERE node_id = :n", n=name)
        return rows[0] if rows else None

    def node_info(self, name: str) -> dict[str, Any]:
        row = self.node(name)
        return {} if row is None else dict(json.loads(row.info))


def pct(values: list[int], q: float) -> int:
    """Nearest-rank percentile (0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def empty_tables(url: str, tables: str) -> None:
    """``TRUNCATE tables`` (a comma-separated list) and free every id lease."""
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {tables}"))
        conn.execute(text("UPDATE ax_id_lease SET owner = NULL, lease_until = 0"))
    engine.dispose()


S = TypeVar("S", bound=System)


@contextmanager
def module_cluster(make: Callable[[dict[str, str]], S], database_url: str, redis_url: str,
                   name: str, tables: str) -> Iterator[S]:
    """The system ``make`` builds from its broker settings
    (:func:`tests.services.own_redis_broker`), for one test module: ``tables`` of
    ``database_url`` are emptied before and after; at the end every daemon is stopped, the
    system closed and its Redis keys deleted."""
    empty_tables(database_url, tables)
    broker = own_redis_broker(redis_url, f".{name}{uuid.uuid4().hex[:6]}")
    ax = make(broker)
    try:
        yield ax
    finally:
        stop_all([d.proc for d in ax.daemons])
        ax.close()
        empty_tables(database_url, tables)
        delete_redis_keys(redis_url, broker["broker_key_prefix"])
