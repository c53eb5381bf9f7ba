"""Helpers the benchmarks share: a scratch PostgreSQL database, a scratch RabbitMQ vhost,
Redis key cleanup, process figures from ``/proc``, percentiles, machine info."""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import text

from ax_kombu.store.engine import make_engine, migrate

PG_ADMIN = os.environ.get("AX_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
AMQP_ROOT = os.environ.get("AX_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672")
#: while this file exists someone needs the machine quiet: long runs wait (:func:`wait_quiet`)
QUIET_FLAG = Path("/tmp/ax_quiet")


@contextmanager
def scratch_database(name: str, migrated: bool = True, admin_url: str = PG_ADMIN
                     ) -> Iterator[str]:
    """A fresh PostgreSQL database on the server of ``admin_url``, with ax's schema unless
    ``migrated`` is false; dropped afterwards."""
    admin = make_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = admin_url.rsplit("/", 1)[0] + "/" + name
    if migrated:
        engine = make_engine(url)
        migrate(engine)
        engine.dispose()
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


#: PostgreSQL's advice for a dedicated server ("a reasonable starting value for
#: shared_buffers is 25% of the memory in your system"): the share :func:`private_server`
#: gives it
SHARED_BUFFERS_SHARE = 0.25


@contextmanager
def private_server(port: int = 5440, settings: dict[str, str] | None = None
                   ) -> Iterator[str]:
    """A PostgreSQL server of the benchmark's own, for as long as the block runs: made by
    ``initdb`` in a temporary directory (run as the ``postgres`` user: needs root), on
    127.0.0.1:``port``, configured as PostgreSQL's documentation advises for a dedicated
    server (``shared_buffers`` a quarter of the machine's memory; everything else, autovacuum
    included, at its default) plus ``settings``; stopped and deleted afterwards. Yields
    the URL of its ``postgres`` database (trust authentication)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not found or os.geteuid() != 0 or shutil.which("runuser") is None:
        raise RuntimeError("a private PostgreSQL server needs root, runuser and PostgreSQL's "
                           "server programs (/usr/lib/postgresql/*/bin); use the shared "
                           "server instead (AX_BENCH_PG_URL)")
    bindir = found[-1].parent
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    config = {"listen_addresses": "127.0.0.1",
              "shared_buffers": f"{int(memory_mb * SHARED_BUFFERS_SHARE)}MB",
              **(settings or {})}
    base = Path(tempfile.mkdtemp(prefix="ax_bench_pg_"))
    data = base / "data"

    def as_postgres(*args: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *args], check=True,
                       capture_output=True, timeout=120)

    try:
        shutil.chown(base, "postgres")
        as_postgres(str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust")
        options = [f"-p {port}", f"-k {base}", *(f"-c {k}={v}" for k, v in config.items())]
        as_postgres(str(bindir / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(data),
                    "-l", str(base / "server.log"), "-o", " ".join(options))
        try:
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
        finally:
            as_postgres(str(bindir / "pg_ctl"), "stop", "-m", "fast", "-w", "-D", str(data))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def machine() -> str:
    return f"{os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}"


@contextmanager
def rabbit_vhost(name: str) -> Iterator[str]:
    """A fresh RabbitMQ vhost ``name`` (guest may use it), deleted afterwards; yields its URL.

    Raises:
        RuntimeError: ``rabbitmqctl`` is missing or refused.
    """
    ctl = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
    _rabbitmqctl(ctl, "delete_vhost", name, check=False)
    _rabbitmqctl(ctl, "add_vhost", name)
    _rabbitmqctl(ctl, "set_permissions", "-p", name, "guest", ".*", ".*", ".*")
    try:
        yield f"{AMQP_ROOT.rstrip('/')}/{name}"
    finally:
        _rabbitmqctl(ctl, "delete_vhost", name, check=False)


def _rabbitmqctl(ctl: str, *args: str, check: bool = True) -> None:
    try:
        done = subprocess.run([ctl, *args], capture_output=True, text=True, timeout=60,
                              check=False)
    except OSError as exc:
        raise RuntimeError(f"rabbitmqctl: {exc}") from None
    if check and done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {done.stderr.strip()}")


def drop_redis_keys(url: str, prefix: str) -> int:
    """Delete every key of the Redis at ``url`` that starts with ``prefix``; returns how many."""
    import redis

    if not prefix:
        raise ValueError("refusing to delete every key: give a prefix")
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        for start in range(0, len(keys), 1000):
            client.delete(*keys[start:start + 1000])
        return len(keys)
    finally:
        client.close()


def proc_mb(pid: int, field: str = "VmRSS") -> int:
    """A memory field of ``/proc/<pid>/status`` in MB (``VmRSS`` now, ``VmHWM`` the peak);
    0 when the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process ``pid`` has used so far (0.0 when gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_quiet(poll_s: float = 5.0) -> None:
    """Return once :data:`QUIET_FLAG` does not exist (someone else needs the machine quiet)."""
    told = False
    while QUIET_FLAG.exists():
        try:  # the flag's owner (its text in AXBENCH_QUIET_OWNER) does not wait for itself
            if QUIET_FLAG.read_text().strip() == os.environ.get("AXBENCH_QUIET_OWNER"):
                return
        except FileNotFoundError:
            return
        if not told:
            print(f"{QUIET_FLAG} exists: waiting until it is gone", flush=True)
            told = True
        time.sleep(poll_s)
