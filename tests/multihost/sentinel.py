"""Redis with Sentinel on loopback, for the multi-host step: a primary, one replica
(``--replicaof``) and three sentinels (``redis-server <conf> --sentinel``, quorum 2),
every one on a free port, its files in the test's directory, and all of them killed
(the whole process group, SIGKILL) at the end.

Faults it can inject, all with real processes and signals:

* :meth:`SentinelSet.cut_replica` — the replica falls behind: it is SIGSTOPped and its
  replication link is closed on the primary (``CLIENT KILL TYPE replica``). Stopping it
  alone is not enough: the primary would go on writing into the link, the kernel would
  buffer the stream for the stopped process, and the replica would apply all of it once
  continued. With the link closed the primary keeps every later write to itself.
* :meth:`SentinelSet.kill_primary` — SIGKILL of the primary; :meth:`resume_replica`
  continues the replica, and the sentinels promote it without the writes it missed.

The test reads each server directly (:meth:`SentinelSet.client`); ax reaches them only
through the sentinels (:attr:`SentinelSet.url` and :attr:`SentinelSet.transport_options`,
what a user puts in ``AX_BROKER_URL`` and ``AX_BROKER_TRANSPORT_OPTIONS``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import redis

from tests.faults.servers import free_port
from tests.faults.timing import poll

MASTER_NAME = "mymaster"
#: a sentinel judges the primary down after this much silence (ms)
DOWN_AFTER_MS = 1000
#: Sentinel's failover timeout (ms): also how long before a failed election is retried
FAILOVER_TIMEOUT_MS = 4000


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisProcess:
    """One redis-server (data or sentinel) in its own process group."""

    def __init__(self, name: str, port: int, argv: list[str], log: Path) -> None:
        self.name, self.port, self.argv, self.log = name, port, argv, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def client(self, timeout: float = 1.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout,
                           socket_connect_timeout=timeout)

    def answers(self) -> bool:
        client = self.client(0.5)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the process group (a stopped process dies too) and reap it."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return f"--- {self.name} :{self.port}\n" + "\n".join(text.splitlines()[-lines:])


class SentinelSet:
    """A primary, a replica and three sentinels; see the module docstring.

    Raises (from :meth:`start`):
        RuntimeError: redis-server is missing, or the set did not come up in time.
    """

    def __init__(self, tmp: Path, sentinels: int = 3, quorum: int = 2) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found")
        self.tmp = tmp
        self.primary = self._data(binary, "primary", None)
        self.replica = self._data(binary, "replica", self.primary.port)
        self.sentinels = [self._sentinel(binary, i, quorum) for i in range(sentinels)]

    def _data(self, binary: str, name: str, replica_of: int | None) -> RedisProcess:
        port = free_port()
        where = self.tmp / name
        where.mkdir()
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(where), "--repl-diskless-sync", "yes",
                "--repl-diskless-sync-delay", "0"]
        if replica_of is not None:
            argv += ["--replicaof", "127.0.0.1", str(replica_of)]
        return RedisProcess(name, port, argv, self.tmp / f"{name}.log")

    def _sentinel(self, binary: str, i: int, quorum: int) -> RedisProcess:
        port = free_port()
        conf = self.tmp / f"sentinel{i}.conf"  # a sentinel rewrites its own conf file
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.tmp}\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.primary.port} {quorum}\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n")
        return RedisProcess(f"sentinel{i}", port, [binary, str(conf), "--sentinel"],
                            self.tmp / f"sentinel{i}.log")

    # -- what a user configures ---------------------------------------------------------------

    @property
    def url(self) -> str:
        """``AX_BROKER_URL``: every sentinel, ``;``-separated."""
        return ";".join(f"sentinel://127.0.0.1:{s.port}/0" for s in self.sentinels)

    @property
    def transport_options(self) -> dict[str, Any]:
        """``AX_BROKER_TRANSPORT_OPTIONS``, as a dict."""
        return {"master_name": MASTER_NAME}

    # -- life cycle -----------------------------------------------------------------------------

    @property
    def processes(self) -> list[RedisProcess]:
        return [self.primary, self.replica, *self.sentinels]

    def start(self, timeout: float = 30.0) -> None:
        """Start everything; return once the replica is in sync and every sentinel
        monitors the primary and knows the replica and the other sentinels."""
        self.primary.start()
        self.replica.start()
        if not poll(lambda: self.info(self.replica).get("master_link_status") == "up",
                    timeout, 0.1):
            raise RuntimeError(f"the replica never synced\n{self.tails()}")
        for sentinel in self.sentinels:
            sentinel.start()
        if not poll(self._monitoring, timeout, 0.2):
            raise RuntimeError(f"the sentinels never saw each other and the replica\n"
                               f"{self.tails()}")

    def _monitoring(self) -> bool:
        others = len(self.sentinels) - 1
        for sentinel in self.sentinels:
            state = self.master_state(sentinel)
            if (state is None or int(state.get("num-slaves", 0)) < 1
                    or int(state.get("num-other-sentinels", 0)) < others):
                return False
        return True

    def stop(self) -> None:
        """Kill every process (SIGKILL, whole group); nothing here needs a clean stop."""
        for process in self.processes:
            process.kill()

    def tails(self, lines: int = 15) -> str:
        return "\n".join(p.tail(lines) for p in self.processes)

    # -- reading the servers --------------------------------------------------------------------

    def info(self, server: RedisProcess, section: str = "replication") -> dict[str, Any]:
        """``INFO section`` of one data server ({} if it does not answer)."""
        client = server.client()
        try:
            return dict(client.info(section))
        except redis.RedisError:
            return {}
        finally:
            client.close()

    def master_state(self, sentinel: RedisProcess) -> dict[str, Any] | None:
        client = sentinel.client()
        try:
            flat = client.execute_command("SENTINEL", "MASTER", MASTER_NAME)
        except redis.RedisError:
            return None
        finally:
            client.close()
        pairs = flat.items() if isinstance(flat, dict) else zip(flat[::2], flat[1::2],
                                                                   strict=True)
        return {_text(k): _text(v) for k, v in pairs}

    def master_port(self, sentinel: RedisProcess) -> int | None:
        """The primary's port as ``sentinel`` names it now (None: no answer)."""
        client = sentinel.client()
        try:
            address: Any = client.sentinel_get_master_addr_by_name(MASTER_NAME)  # (ip, port)
        except redis.RedisError:
            return None
        finally:
            client.close()
        return int(address[1]) if address else None

    def promoted(self) -> bool:
        """Every sentinel names the replica as the primary, and it says it is one."""
        return (all(self.master_port(s) == self.replica.port for s in self.sentinels)
                and self.info(self.replica).get("role") == "master")

    # -- faults ----------------------------------------------------------------------------------

    def cut_replica(self) -> None:
        """SIGSTOP the replica, then close its link on the primary (see the module
        docstring): from now on the primary's writes reach no replica."""
        self.replica.signal(signal.SIGSTOP)
        client = self.primary.client()
        try:
            killed = client.execute_command("CLIENT", "KILL", "TYPE", "replica")
        finally:
            client.close()
        if not killed:
            raise RuntimeError("the primary had no replica link to close")

    def kill_primary(self) -> None:
        self.primary.kill()

    def resume_replica(self) -> None:
        self.replica.signal(signal.SIGCONT)
