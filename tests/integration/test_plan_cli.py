"""``ax plan``: the real console script; ``--from-history`` on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert

from ax_kombu.store.engine import make_engine, migrate
from ax_kombu.store.schema import attempts

pytestmark = pytest.mark.timeout(120)

from .ax_cli import run_ax

HOUR_MS = 3_600_000


def ax(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_ax(*args, cwd=cwd)


def ok(*args: str) -> str:
    proc = ax(*args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def plan_json(db: str, *args: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(ok("--db", db, "plan", *args, "--json"))
    return found


def one_error_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    lines = proc.stderr.splitlines()
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("ax: error:"), proc.stderr
    assert proc.stdout == ""
    return lines[0]


def test_the_contract_example_as_json_reads_no_store(tmp_path: Path) -> None:
    proc = ax("plan", "--peak-rate", "2000", "--avg-ms", "200", "--threads-per-node", "100",
              "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "threads": 400, "nodes": 4, "queue_length": 80_000, "per_thread_rate": 5.0,
        "peak_rate": 2000.0, "avg_ms": 200.0, "threads_per_node": 100}
    assert list(tmp_path.iterdir()) == []  # the default sqlite:///ax.sqlite3 was not opened


def test_text_output_is_aligned_lines() -> None:
    text = ok("plan", "--peak-rate", "2001", "--avg-ms", "200")  # default 100 threads a node
    assert text.splitlines() == [
        "peak rate     2001 tasks/s",
        "average run   200 ms",
        "per thread    5 tasks/s",
        "threads       401",
        "nodes         5  (100 threads each)",
        "queue length  80200  (200 per thread)",
    ]
    fractional = ok("plan", "--peak-rate", "2.5", "--avg-ms", "300", "--threads-per-node", "7")
    assert "per thread    3.333 tasks/s" in fractional.splitlines()


@pytest.mark.parametrize(("args", "says"), [
    (("--peak-rate", "-5", "--avg-ms", "200"), "peak_rate must be a positive"),
    (("--peak-rate", "2000", "--avg-ms", "0"), "avg_ms must be a positive"),
    (("--peak-rate", "2000", "--avg-ms", "inf"), "avg_ms must be a positive"),
    (("--peak-rate", "2000"), "give --avg-ms D or --from-history TYPE"),
    (("--peak-rate", "2000", "--avg-ms", "200", "--threads-per-node", "0"), "threads_per_node"),
    (("--peak-rate", "lots", "--avg-ms", "200"), "'--peak-rate'"),
    (("--avg-ms", "200",), "Missing option '--peak-rate'"),
    (("--peak-rate", "1", "--avg-ms", "1", "--since", "1h"), "--since needs --from-history"),
])
def test_bad_input_is_one_line_exit_2(args: tuple[str, ...], says: str, tmp_path: Path) -> None:
    line = one_error_line(ax("plan", *args, cwd=tmp_path), 2)
    assert says in line
    assert "Usage" not in line


def _insert_history(url: str) -> None:
    """Runs of ``report`` of 100..400 ms in the last hour (avg 250), one of 10 s two hours
    ago, one that never started, and a run of another type."""
    engine = make_engine(url)
    migrate(engine)
    now = int(time.time() * 1000)
    rows = [_run(i, "report", now - 60_000 * i, ms) for i, ms in
            enumerate((100, 200, 300, 400), start=1)]
    rows += [_run(10, "report", now - 2 * HOUR_MS, 10_000), _run(11, "report", now - 1000, None),
             _run(12, "other", now - 1000, 99_999)]
    with engine.begin() as conn:
        conn.execute(insert(attempts), rows)
    engine.dispose()


def _run(task_id: int, task_type: str, finished_at: int, ms: int | None) -> dict[str, Any]:
    started = None if ms is None else finished_at - ms
    return {"task_id": task_id, "attempt": 1, "task_type": task_type, "node": "w1",
            "trigger_time": finished_at - 20_000, "dispatched_at": finished_at - 15_000,
            "started_at": started, "finished_at": finished_at,
            "outcome": "SUCCESS" if ms is not None else "UNACKED", "error": None,
            "duration_ms": ms}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def history_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store with the runs of :func:`_insert_history`, on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'ax.sqlite3'}"
    else:
        url = request.getfixturevalue("pg_url")
    _insert_history(url)
    return url


def test_from_history_uses_the_measured_average(history_db: str) -> None:
    found = plan_json(history_db, "--peak-rate", "1000", "--from-history", "report")
    assert found["from_history"] == {"task_type": "report", "runs": 4, "avg_ms": 250.0,
                                     "p50_ms": 200, "p99_ms": 400, "since": "1h"}
    assert (found["avg_ms"], found["per_thread_rate"], found["threads"], found["nodes"],
            found["queue_length"]) == (250.0, 4.0, 250, 3, 50_000)

    wider = plan_json(history_db, "--peak-rate", "1000", "--from-history", "report",
                      "--since", "3h", "--threads-per-node", "1000")
    assert wider["from_history"] == {"task_type": "report", "runs": 5, "avg_ms": 2200.0,
                                     "p50_ms": 300, "p99_ms": 10_000, "since": "3h"}
    assert (wider["threads"], wider["nodes"]) == (2200, 3)


def test_from_history_wins_over_avg_ms_and_says_so(history_db: str) -> None:
    text = ok("--db", history_db, "plan", "--peak-rate", "1000", "--avg-ms", "10",
              "--from-history", "report")
    lines = text.splitlines()
    assert "average run   250 ms" in lines
    assert "measured      4 runs of report in the last 1h: p50 200 ms, p99 400 ms" in lines
    assert "note          --avg-ms 10 ignored: the history wins" in lines
    assert "threads       250" in lines


def test_no_runs_in_the_window_is_one_line_exit_3(history_db: str) -> None:
    line = one_error_line(ax("--db", history_db, "plan", "--peak-rate", "1000",
                             "--from-history", "nothing.here"), 3)
    assert line == "ax: error: no finished runs of nothing.here in the last 1h"
    line = one_error_line(ax("--db", history_db, "plan", "--peak-rate", "1000",
                             "--from-history", "report", "--since", "30s", "--avg-ms", "5"), 3)
    assert line == "ax: error: no finished runs of report in the last 30s"


def test_bad_rate_with_history_fails_before_reading_the_store(tmp_path: Path) -> None:
    missing = tmp_path / "none.sqlite3"
    line = one_error_line(ax("--db", f"sqlite:///{missing}", "plan", "--peak-rate", "0",
                             "--from-history", "report"), 2)
    assert "peak_rate" in line
    assert not missing.exists()
