"""The fault suite's summary table, at the end of the session.

The table is printed in the terminal summary and appended (with the date and the commit) to
``$AX_FAULTS_SUMMARY``, by default ``ax-faults-summary.md`` in the system's temporary
directory. Under pytest-xdist each worker judges its own scenarios: it hands its rows to the
controller when its session ends (``workeroutput``), and the controller prints them all. The
hooks that call this module are in ``tests/conftest.py``, which the controller loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.system import REPO

from .judge import RESULTS
from .verdict import rows_table

#: the key of the rows in a worker's ``workeroutput``
KEY = "ax_fault_rows"
#: rows the controller received from its workers
FROM_WORKERS: list[list[str]] = []


def hand_to_controller(config: pytest.Config) -> None:
    """On a pytest-xdist worker: send this session's rows to the controller."""
    output = getattr(config, "workeroutput", None)
    if output is not None:
        output[KEY] = json.dumps([v.row() for v in RESULTS])


def take_from_worker(node: Any) -> None:
    """On the controller: keep the rows a worker sent (``node.workeroutput``)."""
    FROM_WORKERS.extend(json.loads(getattr(node, "workeroutput", {}).get(KEY, "[]")))


def report(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the table and append it to the summary file; nothing if no scenario ran here."""
    rows = [v.row() for v in RESULTS] + FROM_WORKERS
    if not rows or hasattr(terminalreporter.config, "workeroutput"):
        return
    text = rows_table(rows)
    path = _summary_path()
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    try:
        with open(path, "a") as out:
            out.write(f"\n## fault suite, {stamp}, commit {_commit()}\n\n{text}\n")
        where = f"(appended to {path})"
    except OSError as exc:
        where = f"(could not append to {path}: {exc})"
    terminalreporter.write_sep("=", "fault-injection summary")
    terminalreporter.write_line(text)
    terminalreporter.write_line(where)


def _summary_path() -> Path:
    return Path(os.environ.get("AX_FAULTS_SUMMARY")
                or Path(tempfile.gettempdir()) / "ax-faults-summary.md")


def _commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return done.stdout.strip() or "?"
