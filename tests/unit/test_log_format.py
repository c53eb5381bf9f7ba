"""``--log-format text|json`` (``AX_LOG_FORMAT``): one JSON object per line, redacted as
the text format is, from both daemons.

The formatter is tested directly; the daemons are run as the real console scripts, in
subprocesses, on a SQLite store and the ``ax+sqlite`` broker in a temporary directory.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ax_kombu.cli.daemon import JsonFormatter, _TraceFormatter, setup_logging

DAEMONS = {"ax-scheduler": "ax_kombu.cli.scheduler", "ax-worker": "ax_kombu.cli.worker"}
READY = {"ax-scheduler": "ax-scheduler ready", "ax-worker": "worker started"}
#: the line after which a SIGTERM finds the node running (a stop before it ends it silently)
STARTED = {"ax-scheduler": "scheduler started", "ax-worker": "worker started"}
TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def _record(msg: str = "task failed", extra: dict[str, Any] | None = None,
            exc: Exception | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.getLogger("ax_kombu.test").makeRecord(
        "ax_kombu.test", logging.WARNING, __file__, 1, msg, (), exc_info, extra=extra)


def _raised(exc: Exception) -> Exception:
    try:
        raise exc
    except Exception as caught:  # noqa: BLE001 - a traceback to format
        return caught


class _Opaque:
    def __str__(self) -> str:
        return "opaque redis://:hunter2@r:6379/0"


def test_a_record_is_one_object_with_its_fields_and_traceback() -> None:
    record = _record(extra={"task_id": 42, "trace_id": "t-1", "attempt": 3, "node": "w@h.1",
                            "cold": False, "took_s": 0.5, "queues": ["high", "slow"]},
                     exc=_raised(ValueError("boom")))
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert TS.match(entry.pop("ts"))
    exc = entry.pop("exc")
    assert exc.startswith("Traceback (most recent call last):") and "ValueError: boom" in exc
    assert entry == {"level": "WARNING", "logger": "ax_kombu.test", "message": "task failed",
                     "task_id": 42, "trace_id": "t-1", "attempt": 3, "node": "w@h.1",
                     "cold": False, "took_s": 0.5, "queues": ["high", "slow"]}


def test_the_timestamp_is_utc_with_milliseconds() -> None:
    record = _record()
    record.created, record.msecs = 0.25, 250.0
    assert json.loads(JsonFormatter().format(record))["ts"] == "1970-01-01T00:00:00.250Z"


def test_no_exc_key_without_an_exception() -> None:
    assert "exc" not in json.loads(JsonFormatter().format(_record()))


def test_values_json_cannot_hold_are_strings() -> None:
    entry = json.loads(JsonFormatter().format(_record(extra={
        "path": Path("/tmp/x"), "ratio": float("nan"), "opaque": _Opaque(),
        "nested": {"1": (1, 2)}})))
    assert entry["path"] == "/tmp/x" and entry["ratio"] == "nan"
    assert entry["opaque"] == "opaque redis://:***@r:6379/0"
    assert entry["nested"] == {"1": [1, 2]}


def test_a_field_named_like_a_fixed_key_does_not_replace_it() -> None:
    entry = json.loads(JsonFormatter().format(_record(extra={"level": "x", "logger": "y"})))
    assert entry["level"] == "WARNING" and entry["logger"] == "ax_kombu.test"


def test_passwords_and_tokens_are_redacted_and_the_line_stays_json() -> None:
    record = _record(
        msg="cannot reach amqp://u:hunter2@rabbit:5672// for %s",
        extra={"broker": "redis://:hunter2@r:6379/0",
               "callback": 'https://x/cb?token=hunter2"quoted\\back&sslmode=require',
               "dsn": "host=db password=hunter2 user=ax",
               "urls": ["postgresql://u:hunter2@h/db"]},
        exc=_raised(RuntimeError("lost https://h/?token=hunter2")))
    record.args = ("https://h/hook?sig=hunter2",)
    line = JsonFormatter().format(record)
    assert "hunter2" not in line
    entry = json.loads(line)
    assert entry["message"] == "cannot reach amqp://u:***@rabbit:5672// for https://h/hook?sig=***"
    assert entry["broker"] == "redis://:***@r:6379/0"
    assert entry["callback"].startswith("https://x/cb?token=***")
    assert entry["callback"].endswith("&sslmode=require")
    assert entry["dsn"] == "host=db password=*** user=ax"
    assert entry["urls"] == ["postgresql://u:***@h/db"]
    assert "https://h/?token=***" in entry["exc"]


def test_text_and_json_show_the_same_fields() -> None:
    record = _record(extra={"task_id": 7, "trace_id": "abc"})
    text = _TraceFormatter("%(message)s").format(record)
    assert text == "task failed task_id=7 trace_id=abc"
    entry = json.loads(JsonFormatter().format(record))
    assert {k for k in entry if k not in {"ts", "level", "logger", "message"}} == {"task_id",
                                                                                   "trace_id"}


def test_setup_logging_picks_the_format() -> None:
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    try:
        setup_logging("info", "JSON")
        assert isinstance(root.handlers[0].formatter, JsonFormatter)
        setup_logging("info")
        assert isinstance(root.handlers[0].formatter, _TraceFormatter)
    finally:
        root.handlers[:] = saved
        root.setLevel(level)


# -- the daemons, for real ------------------------------------------------------------------


def _command(name: str) -> list[str]:
    """The console script installed next to this interpreter, else ``python -m``."""
    script = Path(sys.executable).with_name(name)
    return [str(script)] if script.exists() else [sys.executable, "-m", DAEMONS[name]]


def _env(extra: dict[str, str]) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("AX_")}, **extra}


def _store(tmp_path: Path) -> dict[str, str]:
    return {"AX_DATABASE_URL": f"sqlite:///{tmp_path / 'ax.db'}",
            "AX_BROKER_URL": f"ax+sqlite:///{tmp_path / 'broker.db'}"}


def _json_lines(stderr: str) -> list[dict[str, Any]]:
    entries = [json.loads(line) for line in stderr.splitlines()]
    for entry in entries:
        assert {"ts", "level", "logger", "message"} <= entry.keys(), entry
    return entries


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,how", [("ax-scheduler", "flag"), ("ax-worker", "flag"),
                                      ("ax-scheduler", "env"), ("ax-worker", "env")])
def test_a_daemon_logs_json_lines_from_start_to_stop(name: str, how: str,
                                                     tmp_path: Path) -> None:
    args, env = (["--log-format", "json"], {}) if how == "flag" else ([], {"AX_LOG_FORMAT": "json"})
    proc = subprocess.Popen(_command(name) + args, env=_env({**_store(tmp_path), **env}),
                            cwd=tmp_path, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True)
    seen: list[str] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            if STARTED[name] in line:
                break
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = "".join(seen) + rest
    assert proc.returncode == 0, stderr
    entries = _json_lines(stderr)
    ready = [e for e in entries if e["message"] == READY[name]]
    assert len(ready) == 1 and ready[0]["node"], stderr
    assert ready[0]["level"] == "INFO" and ready[0]["logger"].startswith("ax_kombu.")
    assert any(e["message"].endswith("stopped") for e in entries), stderr


@pytest.mark.parametrize("name", sorted(DAEMONS))
@pytest.mark.parametrize("args,env", [(["--log-format", "xml"], {}), ([], {"AX_LOG_FORMAT": "xml"})])
def test_an_unknown_log_format_is_one_line_and_exit_2(name: str, args: list[str],
                                                      env: dict[str, str],
                                                      tmp_path: Path) -> None:
    result = subprocess.run(_command(name) + args, env=_env({**_store(tmp_path), **env}),
                            cwd=tmp_path, capture_output=True, text=True, timeout=20, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "ax: error: Invalid value for '--log-format': 'xml' is not one of 'json', 'text'. "
        + f"(see '{name} -h')"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", sorted(DAEMONS))
def test_a_bad_setting_in_json_mode_is_still_one_line_without_the_password(
        name: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [*_command(name), "--log-format", "json"],
        env=_env({"AX_DATABASE_URL": "mysql://u:hunter2@h/db"}), cwd=tmp_path,
        capture_output=True, text=True, timeout=20, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ax: error: AX_DATABASE_URL: unsupported database 'mysql' in "
                               "'mysql://u:***@h/db'"), result.stderr
    assert "hunter2" not in result.stderr
