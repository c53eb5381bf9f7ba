"""``ax jobs``: the real console script against a SQLite store in a temporary directory."""

from __future__ import annotations

import itertools
import json
import subprocess
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from .ax_cli import run_ax

pytestmark = pytest.mark.timeout(120)


class Ax:
    """Runs ``ax --db sqlite:///… ARGS`` and returns the finished process."""

    def __init__(self, tmp_path: Path) -> None:
        self.db = f"sqlite:///{tmp_path / 'ax.sqlite3'}"

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_ax("--db", self.db, *args)

    def ok(self, *args: str) -> str:
        proc = self(*args)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    def jobs(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = json.loads(self.ok("jobs", "list", "--json"))
        return found


@pytest.fixture
def ax(tmp_path: Path) -> Ax:
    return Ax(tmp_path)


def _next_shanghai_eight() -> str:
    """The next 08:00 in Asia/Shanghai (UTC+8, no DST): the next 00:00 UTC."""
    now = datetime.now(UTC)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(days=1)
    return midnight.astimezone(timezone(timedelta(hours=8))).isoformat()


def _one_error_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    lines = proc.stderr.splitlines()
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("ax: error:"), proc.stderr
    assert proc.stdout == ""
    return lines[0]


def test_add_is_listed_with_its_next_fire_and_is_idempotent(ax: Ax) -> None:
    before = _next_shanghai_eight()
    args = ("jobs", "add", "report.daily", "report", "--cron", "0  8 * * *",
            "--tz", "Asia/Shanghai", "--payload", '{"kind": "daily"}')
    first = ax.ok(*args)
    again = ax.ok(*args)
    ax.ok("jobs", "add", "tick", "beat", "--every", "90s", "--misfire", "skip",
          "--grace", "1500ms", "--priority", "high")
    text = ax.ok("jobs", "list")
    found = {j["name"]: j for j in ax.jobs()}
    expected = {before, _next_shanghai_eight()}  # the same unless midnight UTC passed meanwhile

    assert first == again
    assert first.strip() in {f"report.daily: cron '0 8 * * *' Asia/Shanghai, next {e}"
                             for e in expected}
    assert sorted(found) == ["report.daily", "tick"]  # added twice, one job
    daily, tick = found["report.daily"], found["tick"]
    assert daily["next_fire_at"] in expected
    assert daily == {"name": "report.daily", "task_type": "report", "cron": "0 8 * * *",
                     "every_s": None, "tz": "Asia/Shanghai", "misfire": "fire_once",
                     "misfire_grace_s": None, "strategy": "parallel", "priority": "default",
                     "paused": False,
                     "next_fire_at": daily["next_fire_at"], "payload": {"kind": "daily"}}
    assert (tick["cron"], tick["every_s"], tick["tz"], tick["misfire"], tick["misfire_grace_s"],
            tick["priority"], tick["payload"]) == (None, 90.0, "UTC", "skip", 1.5, "high", None)
    tick_at = datetime.fromisoformat(tick["next_fire_at"])
    assert tick_at.utcoffset() == timedelta(0)
    assert timedelta(0) < tick_at - datetime.now(UTC) <= timedelta(seconds=90)

    header, *rows = text.splitlines()
    assert header.split() == ["name", "schedule", "task", "type", "misfire", "strategy",
                              "paused", "next", "fire"]
    assert rows[0].split() == ["report.daily", "cron", "'0", "8", "*", "*", "*'",
                               "Asia/Shanghai", "report", "fire_once", "parallel", "no",
                               daily["next_fire_at"]]
    assert rows[1].split() == ["tick", "every", "90s", "beat", "skip", "parallel", "no",
                               tick["next_fire_at"]]


def test_next_pause_resume_remove(ax: Ax) -> None:
    ax.ok("jobs", "add", "sec", "t", "--cron", "* * * * * *")
    times = [datetime.fromisoformat(line) for line in ax.ok("jobs", "next", "sec", "-n", "3")
             .splitlines()]
    assert len(times) == 3 and all(t.utcoffset() == timedelta(0) for t in times)
    assert [b - a for a, b in itertools.pairwise(times)] == [timedelta(seconds=1)] * 2
    assert times[0] > datetime.now(UTC) - timedelta(seconds=5)

    assert ax.ok("jobs", "pause", "sec").strip() == "sec: cron '* * * * * *' UTC, paused"
    [paused] = ax.jobs()
    assert (paused["paused"], paused["next_fire_at"]) == (True, None)

    resumed = ax.ok("jobs", "resume", "sec").strip()
    prefix = "sec: cron '* * * * * *' UTC, next "
    assert resumed.startswith(prefix)
    assert datetime.fromisoformat(resumed.removeprefix(prefix)) >= times[0]

    # no scheduler ran, so no occurrence was written ahead
    assert ax.ok("jobs", "remove", "sec").strip() == "sec: removed (0 undispatched occurrences)"
    assert ax.jobs() == []
    assert _one_error_line(ax("jobs", "remove", "sec"), 3) == "ax: error: no recurring job 'sec'"


def test_bad_input_is_one_line_exit_2_and_writes_nothing(ax: Ax) -> None:
    cases = {
        "bad cron": ("--cron", "61 * * * *"),
        "unknown zone": ("--cron", "0 8 * * *", "--tz", "Mars/Olympus"),
        "both": ("--cron", "0 8 * * *", "--every", "5s"),
        "neither": (),
        "bad duration": ("--every", "5 fortnights"),
    }
    for case, extra in cases.items():
        line = _one_error_line(ax("jobs", "add", "bad", "t", *extra), 2)
        assert "Usage" not in line, case
    assert ax.jobs() == []


def test_inspect_shows_an_occurrences_job_strategy_and_a_tasks_order_key_and_shard(
        ax: Ax) -> None:
    from ax_kombu.api import Client
    from ax_kombu.config import from_env
    from ax_kombu.core.ids import ReservedIds
    from ax_kombu.scheduler.recurrence import Materialiser
    from ax_kombu.store.leases import StoreReserver

    ax.ok("jobs", "add", "recon", "recon.run", "--every", "1s", "--strategy", "serial")
    settings = from_env({}, database_url=ax.db)
    client = Client(settings)
    try:
        ids = ReservedIds(StoreReserver(client.store.engine), "test", 60_000, client.store.now_ms)
        Materialiser(settings, client.store, ids).run(client.store.now_ms())
        occurrence = client.occurrences("recon", 1)[0]
        sharded = client.enqueue("reindex", {"index": "orders"}, order_key="k", shards=2)
    finally:
        client.close()
    shown = json.loads(ax.ok("inspect", str(occurrence.task_id), "--json"))
    assert (shown["job"], shown["strategy"], shown["order_key"]) == (
        "recon", "serial", "ax.job:recon")
    second = json.loads(ax.ok("inspect", str(sharded.shards[1]), "--json"))
    assert (second["order_key"], second["shard_index"], second["shard_total"]) == ("k", 1, 2)
    assert "strategy" not in second


def test_run_writes_one_occurrence_due_now_gated_by_its_strategy(ax: Ax) -> None:
    ax.ok("jobs", "add", "recon", "recon.run", "--every", "1h", "--strategy", "serial")
    ax.ok("jobs", "pause", "recon")  # an operator's run is not a scheduled one
    before = datetime.now(UTC)
    out = ax.ok("jobs", "run", "recon").strip()
    name, _, rest = out.partition(": task ")
    task_id = rest.removesuffix(" due now")
    assert name == "recon" and task_id.isdigit(), out
    shown = json.loads(ax.ok("inspect", task_id, "--json"))
    assert (shown["job"], shown["strategy"], shown["order_key"], shown["status"]) == (
        "recon", "serial", "ax.job:recon", "READY")
    assert datetime.fromisoformat(shown["trigger_time"]) >= before - timedelta(seconds=5)
    assert _one_error_line(ax("jobs", "run", "nope"), 3) == "ax: error: no recurring job 'nope'"
