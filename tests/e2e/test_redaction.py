"""Secrets stay out of what ax shows: a real ``ax-scheduler`` and ``ax-worker`` on a
PostgreSQL URL with a password and a Redis URL with a password (Redis ≥ 6 accepts any
password for its ``default`` user when none is set), running tasks whose callback URLs and
errors carry ``?token=…``. Every line each daemon logs, the output of ``ax status`` (text
and JSON) and every task's ``last_error`` must contain no secret — and show the redacted
``***`` forms instead, so the test would notice if the URLs were not there at all.
"""

from __future__ import annotations

import http.server
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import pytest

from ..loopback_http import serving
from .system import System

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(120)]

PASSWORD = "s3cr3t-pw"
TOKEN = "s3cr3t-tok"
SECRETS = (PASSWORD, TOKEN, "s3cr3t")


def _with_password(url: str, user: str) -> str:
    parts = urlsplit(url)
    netloc = f"{user}:{PASSWORD}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return parts._replace(netloc=netloc).geturl()


class _Failing(http.server.BaseHTTPRequestHandler):
    """Answers every POST with 500 and remembers the paths it was called on."""

    calls: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.calls.append(self.path)
        self.send_response(500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    with serving(_Failing) as url:
        yield f"{url}/hook"


@pytest.fixture
def system(pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> Iterator[System]:
    broker = {**redis_broker, "broker_url": _with_password(redis_broker["broker_url"],
                                                           "default")}
    ax = System(_with_password(pg_url, urlsplit(pg_url).username or "postgres"), broker,
                tmp_path, env={"callback_allow_hosts": "127.0.0.1"})
    yield ax
    ax.close()


def _ax(system: System, *args: str) -> str:
    ax = Path(sys.executable).parent / "ax"
    command = [str(ax)] if ax.exists() else [sys.executable, "-c",
                                             "from ax_kombu.cli import main; main()"]
    done = subprocess.run([*command, "-l", "DEBUG", *args], env=system.daemon_env(),
                          capture_output=True, text=True, timeout=60, cwd=system.tmp,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def _assert_clean(what: str, text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} shown in {what}:\n" + "\n".join(
            line for line in text.splitlines() if secret in line)


def test_no_secret_in_logs_status_or_last_error(system: System, receiver: str) -> None:
    assert PASSWORD in system.database_url and PASSWORD in system.broker["broker_url"]
    system.scheduler("s1")
    system.worker("w1", args=["-A", "tests.e2e.redaction_tasks"])
    system.wait_ready()
    ids = system.enqueue_many([
        # a callback that answers 500 (allowed host), one refused (a host not allowed)
        {"task_type": "hook", "payload": {"n": 1}, "max_retry": 0,
         "callback_url": f"{receiver}?token={TOKEN}&user=me"},
        {"task_type": "hook", "payload": {"n": 2}, "max_retry": 0,
         "callback_url": f"http://10.255.255.1/hook?token={TOKEN}"},
        # a processor that logs and raises with the URL it called
        {"task_type": "redaction.leaky", "max_retry": 0,
         "payload": {"url": f"https://api.example.com/v1?token={TOKEN}"}},
        {"task_type": "redaction.leaky", "max_retry": 1, "delay": 0.1,
         "payload": {"url": f"https://u:{PASSWORD}@api.example.com/v1"}},
    ])
    system.wait_for(lambda: all(system.tasks()[i].status == "FAILED" for i in ids), 60,
                    "every task FAILED", detail=lambda: {i: system.tasks()[i].status
                                                         for i in ids})
    assert _Failing.calls and TOKEN in _Failing.calls[0]  # the secret really was used

    errors = {i: system.tasks()[i].last_error or "" for i in ids}
    for i, error in errors.items():
        _assert_clean(f"last_error of task {i}", error)
    assert "token=***" in errors[ids[2]] and ":***@api.example.com" in errors[ids[3]]

    status = _ax(system, "status") + _ax(system, "status", "--json")
    _assert_clean("ax status", status)
    assert ":***@" in status

    system.close()  # every daemon flushed and gone
    for daemon in system.daemons:
        _assert_clean(f"{daemon.name}'s log", daemon.log.read_text(errors="replace"))
    worker_log = (system.tmp / "w1.log").read_text()
    scheduler_log = (system.tmp / "s1.log").read_text()
    assert ":***@" in scheduler_log
    assert "token=***" in worker_log
