"""Start-up checks: a broker or database URL that can never work stops a daemon at once.

The check functions are tested directly; the daemons are run as the real
console scripts, in subprocesses, to see the one line and the exit code a
user sees. Nothing here needs a server: the checks never connect.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kombu.transport import TRANSPORT_ALIASES

from ax_kombu.broker.connection import check_broker_url
from ax_kombu.exceptions import ConfigurationError
from ax_kombu.store.engine import check_database_url, make_engine

DAEMONS = {"ax-scheduler": "ax_kombu.cli.scheduler", "ax-worker": "ax_kombu.cli.worker"}


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0", "amqp://guest:guest@127.0.0.1//", "memory://",
    "ax+sqlite:///tmp/b.db", "rediss://:pw@127.0.0.1:6380/1", "redis://h1:6379/0;redis://h2:6379/0",
])
def test_usable_broker_urls_pass(url: str) -> None:
    check_broker_url(url)


@pytest.mark.parametrize("url", [
    "sqlite:///tmp/x.db", "postgresql://u@127.0.0.1/db", "postgres://u:pw@127.0.0.1:5432/db",
    "postgresql+psycopg2://u@127.0.0.1/db?sslmode=disable",
])
def test_usable_database_urls_pass(url: str) -> None:
    check_database_url(url)


def test_a_server_that_is_down_is_not_a_configuration_error() -> None:
    start = time.monotonic()
    check_broker_url("redis://127.0.0.1:1/0")
    check_broker_url("amqp://guest:guest@127.0.0.1:1//")
    check_database_url("postgresql://u@127.0.0.1:1/db")
    assert time.monotonic() - start < 2.0  # nothing tried to connect


@pytest.mark.parametrize("url,message", [
    ("nosuch://x", "unknown transport 'nosuch' (use e.g. redis://"),
    ("rediss2://x", "unknown transport 'rediss2' (did you mean rediss://?"),
    ("redis://h:6379/0;nosuch://x", "unknown transport 'nosuch'"),
    ("notaurl", "not a broker URL: 'notaurl'"),
    ("ax+sqlite://", "Invalid ax+sqlite URL 'ax+sqlite://': the database path is empty"),
    ("ax+sqlite://host/x.db", "Invalid ax+sqlite URL 'ax+sqlite://host/x.db': a host part"),
    ("amqp://u:hunter2@h:notaport//", "malformed broker URL 'amqp://u:***@h:notaport//': Port"),
])
def test_unusable_broker_urls_are_configuration_errors(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        check_broker_url(url)
    assert str(caught.value).startswith(message)
    assert "hunter2" not in str(caught.value)


def test_a_transport_whose_module_is_missing_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TRANSPORT_ALIASES, "broken", "ax_no_such_module:Transport")
    with pytest.raises(ConfigurationError, match="^the 'broken' transport cannot be loaded: "
                                                 "No module named 'ax_no_such_module'$"):
        check_broker_url("broken://x")


@pytest.mark.parametrize("url,message", [
    ("postgresql://:::bad", "malformed database URL 'postgresql://:::bad': the port is not a"),
    ("postgresql://u:hunter2@h:port/db", "malformed database URL 'postgresql://u:***@h:port/db'"),
    ("notaurl", "not a database URL: 'notaurl'"),
    ("mysql://u:hunter2@h/db", "unsupported database 'mysql' in 'mysql://u:***@h/db'"),
    ("nosuch://x", "unsupported database 'nosuch'"),
    ("postgresql+nosuch://u@h/db", "unknown database driver 'postgresql+nosuch'"),
    ("sqlite://", "an in-memory SQLite database cannot be shared"),
    ("sqlite:///:memory:", "an in-memory SQLite database cannot be shared"),
])
def test_unusable_database_urls_are_configuration_errors(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        check_database_url(url)
    assert str(caught.value).startswith(message)
    assert "hunter2" not in str(caught.value)


def test_a_missing_database_driver_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg2", None)  # makes `import psycopg2` fail
    with pytest.raises(ConfigurationError,
                       match="^the postgresql\\+psycopg2 driver cannot be loaded: "):
        check_database_url("postgresql://u@127.0.0.1/db")


def test_make_engine_still_opens_postgres_urls_with_psycopg2(tmp_path: Path) -> None:
    for url in ("postgres://u@h/db", "postgresql://u@h/db"):
        engine = make_engine(url)
        assert engine.url.drivername == "postgresql+psycopg2"
        engine.dispose()
    engine = make_engine(f"sqlite:///{tmp_path / 'x.db'}")
    assert engine.url.get_backend_name() == "sqlite"
    engine.dispose()


def _daemon(name: str) -> list[str]:
    """The console script installed next to this interpreter, else ``python -m``."""
    script = Path(sys.executable).with_name(name)
    return [str(script)] if script.exists() else [sys.executable, "-m", DAEMONS[name]]


def _run(name: str, args: list[str], env: dict[str, str], cwd: Path,
         pre: str = "") -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AX_")}
    clean["AX_WORKER_PROCESSES"] = "1"
    command = _daemon(name) + args
    if pre:  # run the console script's entry point after ``pre``, in one interpreter
        command = [sys.executable, "-c", f"{pre}\nfrom {DAEMONS[name]} import main\nmain()",
                   *args]
    return subprocess.run(command, env={**clean, **env}, cwd=cwd, capture_output=True,
                          text=True, timeout=10, check=False)


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("name", sorted(DAEMONS))
@pytest.mark.parametrize("env,args,line", [
    ({"AX_BROKER_URL": "nosuch://x"}, [],
     "ax: error: AX_BROKER_URL: unknown transport 'nosuch' (use e.g. redis://"),
    ({}, ["--broker", "nosuch://x"],
     "ax: error: AX_BROKER_URL (--broker): unknown transport 'nosuch'"),
    ({"AX_DATABASE_URL": "postgresql://:::bad"}, [],
     "ax: error: AX_DATABASE_URL: malformed database URL 'postgresql://:::bad': the port is not"),
    ({"AX_DATABASE_URL": "notaurl"}, [],
     "ax: error: AX_DATABASE_URL: not a database URL: 'notaurl'"),
    ({"AX_DATABASE_URL": "mysql://u:hunter2@h/db"}, [],
     "ax: error: AX_DATABASE_URL: unsupported database 'mysql' in 'mysql://u:***@h/db'"),
])
def test_a_daemon_refuses_an_unusable_url_in_one_line(name: str, env: dict[str, str],
                                                      args: list[str], line: str,
                                                      tmp_path: Path) -> None:
    result = _run(name, args, env, tmp_path)
    assert _one_line(result).startswith(line), result.stderr
    assert result.returncode == 2
    assert "hunter2" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # refused before opening the store or the broker


@pytest.mark.parametrize("name", sorted(DAEMONS))
def test_a_daemon_names_a_transport_module_that_is_not_installed(name: str,
                                                                 tmp_path: Path) -> None:
    # As after `pip install kombu` without its redis extra: kombu.transport.redis
    # imports `packaging`, which is then missing.
    hide = "import sys\nsys.modules['packaging'] = sys.modules['packaging.version'] = None"
    result = _run(name, [], {"AX_BROKER_URL": "redis://:hunter2@127.0.0.1:6379/0"}, tmp_path,
                  pre=hide)
    assert _one_line(result).startswith(
        "ax: error: AX_BROKER_URL: the 'redis' transport cannot be loaded: "), result.stderr
    assert "packaging" in result.stderr and "hunter2" not in result.stderr
