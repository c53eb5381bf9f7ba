"""A private PostgreSQL primary and a streaming standby on free loopback ports, for the
failover scenario of issue 24.

The primary is made with ``initdb``, allows replication from 127.0.0.1 and runs with
``wal_level = replica`` and **synchronous** replication (``synchronous_standby_names =
'*'``, ``synchronous_commit = on``): a commit is acknowledged only once the standby has
flushed it, so nothing a client was told is committed is missing after a failover. The
standby is a ``pg_basebackup -R`` copy on a second port; it runs with no synchronous
standby of its own, so once promoted it commits alone, as a new primary does until an
operator gives it a standby.

PostgreSQL refuses to run as root: every server program runs as the ``postgres`` user, in
a directory of its own under the system's temporary directory (pytest's ``tmp_path`` lies
under a root-only ``/tmp/pytest-of-root``, which ``postgres`` cannot enter). The
servers' logs are copied into the test's directory when the pair is closed, and the
private directory removed. The shared server on 5432 is never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psycopg2

from tests.faults.servers import free_port
from tests.faults.timing import poll

#: the database ax uses on the pair
DATABASE = "ax"
#: settings of both servers: small, quick to start, enough connections for 4 daemons
#: (a pool of 5 + 10 each, and a heartbeat connection), the producer and the test
COMMON_CONF = {
    "listen_addresses": "'127.0.0.1'",
    "max_connections": "200",
    "shared_buffers": "32MB",
    "wal_level": "replica",
    "max_wal_senders": "4",
    "hot_standby": "on",
    "synchronous_commit": "on",
    "wal_receiver_status_interval": "1s",
    "logging_collector": "off",
    "log_min_messages": "warning",
}
HBA = ("local all all trust\n"
       "host all all 127.0.0.1/32 trust\n"
       "host replication all 127.0.0.1/32 trust\n")


def as_postgres(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL program as the ``postgres`` user; raise with its output if it fails."""
    done = subprocess.run(["runuser", "-u", "postgres", "--", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: "
                           f"{(done.stderr or done.stdout).strip()[-2000:]}")
    return done


class PgServer:
    """One server of the pair: its data directory, port and log; started by ``pg_ctl``."""

    def __init__(self, name: str, bindir: Path, base: Path, port: int,
                 overrides: dict[str, str] | None = None) -> None:
        self.name, self.bindir, self.port = name, bindir, port
        self.data = base / name
        self.log = base / f"{name}.log"
        self.sockets = base / "sockets"
        self.overrides = dict(overrides or {})

    def program(self, name: str) -> str:
        return str(self.bindir / name)

    def start(self) -> None:
        options = [f"-p {self.port}", f"-k {self.sockets}",
                   *(f"-c {k}={v}" for k, v in self.overrides.items())]
        as_postgres(self.program("pg_ctl"), "start", "-w", "-t", "60", "-D", str(self.data),
                    "-l", str(self.log), "-o", " ".join(options), timeout=90)

    def postmaster_pid(self) -> int | None:
        """The postmaster's pid from ``postmaster.pid`` while that process lives."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return pid

    @property
    def running(self) -> bool:
        return self.postmaster_pid() is not None

    def kill(self) -> None:
        """SIGKILL the postmaster and every process it started (backends, WAL sender,
        checkpointer...) at once, as a machine that dies; waits until they are gone.

        ``pg_ctl`` starts the postmaster in a session of its own, so its process group
        holds exactly the server's processes."""
        pid = self.postmaster_pid()
        if pid is None:
            raise RuntimeError(f"{self.name} is not running")
        if os.getpgid(pid) != pid:
            raise RuntimeError(f"{self.name}'s postmaster {pid} leads no process group")
        os.killpg(pid, signal.SIGKILL)
        if not poll(lambda: not _group_alive(pid), 10, 0.02):
            raise RuntimeError(f"{self.name}'s processes outlived SIGKILL")

    def stop_immediate(self) -> None:
        """``pg_ctl stop -m immediate`` if it still runs (never raises: a finalizer)."""
        if self.running:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                as_postgres(self.program("pg_ctl"), "stop", "-m", "immediate", "-w",
                            "-D", str(self.data), timeout=30)
        pid = self.postmaster_pid()
        if pid is not None:  # pg_ctl failed: do not leave a server behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)

    def url(self, database: str = DATABASE) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def query(self, sql: str, database: str = "postgres") -> list[tuple[Any, ...]]:
        """Rows of one statement, on a connection of its own (autocommit)."""
        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres",
                                dbname=database, connect_timeout=5,
                                options="-c statement_timeout=60s")
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(sql)
                return list(cur.fetchall()) if cur.description else []
        finally:
            conn.close()


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie waiting to be reaped by
    init does not: it holds no socket and writes nothing)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


class PgPair:
    """A primary and its synchronous streaming standby; see the module docstring.

    Args:
        bindir: PostgreSQL's server programs (``initdb``, ``pg_ctl``, ``pg_basebackup``).
        keep_logs: where the servers' logs are copied when the pair is closed.
    """

    def __init__(self, bindir: Path, keep_logs: Path) -> None:
        self.bindir, self.keep_logs = bindir, keep_logs
        self.base = Path(tempfile.mkdtemp(prefix="ax-pg-pair-"))
        shutil.chown(self.base, "postgres", "postgres")
        (self.base / "sockets").mkdir()
        shutil.chown(self.base / "sockets", "postgres", "postgres")
        self.primary = PgServer("primary", bindir, self.base, free_port())
        # once promoted it must not wait for a standby of its own
        self.standby = PgServer("standby", bindir, self.base, free_port(),
                                {"synchronous_standby_names": "''"})

    @property
    def url(self) -> str:
        """ax's database URL: libpq's multi-host form, the primary first, read-write only."""
        return (f"postgresql://postgres@127.0.0.1:{self.primary.port},"
                f"127.0.0.1:{self.standby.port}/{DATABASE}?target_session_attrs=read-write")

    def start(self) -> None:
        """initdb and start the primary, create the database, copy it to the standby with
        ``pg_basebackup -R``, start the standby, make it the synchronous standby, and wait
        until it streams as such."""
        as_postgres(str(self.bindir / "initdb"), "-D", str(self.primary.data), "-U", "postgres",
                    "-A", "trust", "-E", "UTF8", "--no-sync", timeout=120)
        with open(self.primary.data / "postgresql.conf", "a") as conf:
            conf.write("\n# ax multihost test pair\n"
                       + "".join(f"{k} = {v}\n" for k, v in COMMON_CONF.items()))
        (self.primary.data / "pg_hba.conf").write_text(HBA)
        shutil.chown(self.primary.data / "pg_hba.conf", "postgres", "postgres")
        self.primary.start()
        self.primary.query(f'CREATE DATABASE "{DATABASE}"')
        as_postgres(str(self.bindir / "pg_basebackup"), "-h", "127.0.0.1",
                    "-p", str(self.primary.port), "-U", "postgres", "-D", str(self.standby.data),
                    "-R", "-X", "stream", "-c", "fast", "--no-sync", timeout=120)
        self.standby.start()
        # only now: with a synchronous standby named and none connected, every commit
        # (CREATE DATABASE, the base backup's checkpoint) would wait for one
        self.primary.query("ALTER SYSTEM SET synchronous_standby_names = '*'")
        self.primary.query("SELECT pg_reload_conf()")
        if not poll(self.streaming_sync, 30, 0.1):
            raise RuntimeError(f"the standby never streamed synchronously: "
                               f"{self.primary.query('SELECT * FROM pg_stat_replication')}")

    def streaming_sync(self) -> bool:
        """Whether the primary's WAL sender streams to the standby as its synchronous one."""
        rows = self.primary.query("SELECT state, sync_state FROM pg_stat_replication")
        return rows == [("streaming", "sync")]

    def promote(self) -> None:
        """``pg_ctl promote`` the standby and wait until it accepts writes."""
        as_postgres(str(self.bindir / "pg_ctl"), "promote", "-w", "-t", "60",
                    "-D", str(self.standby.data), timeout=90)
        if not poll(lambda: self.standby.query("SELECT pg_is_in_recovery()") == [(False,)],
                    30, 0.05):
            raise RuntimeError("the standby is still in recovery after pg_ctl promote")

    def close(self) -> None:
        """Stop both servers (``pg_ctl stop -m immediate``), keep their logs, remove their
        directory."""
        for server in (self.primary, self.standby):
            server.stop_immediate()
        for server in (self.primary, self.standby):
            with contextlib.suppress(OSError):
                shutil.copy(server.log, self.keep_logs / f"pg-{server.name}.log")
        shutil.rmtree(self.base, ignore_errors=True)
