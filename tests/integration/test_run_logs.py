"""Each run's own log lines, on PostgreSQL with a real worker (issue 39): what a processor
logs (``logging.getLogger`` and ``ctx.log``) is kept with its attempt, within its bounds,
apart from what a concurrent run logs; ``ax inspect ID --logs`` and the console's task page
show it; archiving keeps it, purging deletes it. As in test_worker.py the scheduler's part
is done by hand. One broker (Redis) is enough: the lines are written with the run's end."""

from __future__ import annotations

import gzip
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from starlette.testclient import TestClient

import ax_kombu as ax
from ax_kombu.config import Settings, from_env
from ax_kombu.core.states import Status
from ax_kombu.store.admin import purge_finished
from ax_kombu.store.archive import archive_finished
from ax_kombu.store.run_logs import logs_of
from ax_kombu.store.schema import run_log_archive, run_logs
from ax_kombu.web.app import create_app
from ax_kombu.worker.processors import Context

from .ax_cli import Ax
from .harness import eventually
from .test_worker import Dispatch, running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

log = logging.getLogger("tests.runlog")
#: both flooding runs log at once (each waits for the other before its first line)
_together = threading.Barrier(2, timeout=10)


@pytest.fixture(autouse=True)
def _info_kept() -> Iterator[None]:
    """Log levels decide what is emitted, so what is captured: these loggers log INFO."""
    loggers = [log, logging.getLogger("ax.task.t.runlog")]
    for logger in loggers:
        logger.setLevel(logging.INFO)
    yield
    for logger in loggers:
        logger.setLevel(logging.NOTSET)


@ax.processor("t.runlog.flaky")
def _flaky(payload: Any, ctx: Context) -> None:
    log.info("attempt %d starts <script>alert(1)</script>", ctx.attempt)
    ctx.log.warning("from ctx.log, retry %d", ctx.retry_count)
    if ctx.retry_count == 0:
        raise RuntimeError("first run fails")


@ax.processor("t.runlog.flood")
def _flood(payload: Any, ctx: Context) -> None:
    _together.wait()
    for i in range(payload["lines"]):
        log.info("%s %d %s", payload["tag"], i, "x" * payload["width"])


@pytest.fixture
def settings(pg_url: str, redis_broker: dict[str, str]) -> Settings:
    return from_env({}, database_url=pg_url, retry_backoff_base_ms=100,
                    retry_backoff_max_ms=200, retry_backoff_jitter=0.0,
                    heartbeat_interval_s=0.2, worker_grace_s=10, **redis_broker)


@pytest.fixture
def dispatch(settings: Settings) -> Iterator[Dispatch]:
    d = Dispatch(settings)
    yield d
    d.close()


def _run(dispatch: Dispatch, ids: list[int], status: Status = Status.SUCCESS) -> None:
    dispatch.dispatch(ids)
    eventually(lambda: all(dispatch.status(i) is status for i in ids), what=str(status))


def _retried_run(settings: Settings, dispatch: Dispatch) -> int:
    """A task that fails on attempt 1 and succeeds on attempt 2, run by a real worker."""
    task_id = dispatch.enqueue("t.runlog.flaky", {}, max_retry=1)
    with running(settings):
        _run(dispatch, [task_id], Status.DELAYED)
        due = dispatch.view(task_id).trigger_time
        eventually(lambda: dispatch.client.store.now_ms() >= due, what="due")
        _run(dispatch, [task_id])
    return task_id


def test_each_attempt_keeps_its_own_lines_shown_by_inspect_and_the_console(
        settings: Settings, dispatch: Dispatch) -> None:
    task_id = _retried_run(settings, dispatch)
    logs = logs_of(dispatch.client.store.engine, task_id)
    assert sorted(logs) == [1, 2]
    for attempt, kept in logs.items():
        assert kept.cut is None
        assert [(line.level, line.logger) for line in kept.lines] == [
            ("INFO", "tests.runlog"), ("WARNING", "ax.task.t.runlog.flaky")]
        assert kept.lines[0].msg == f"attempt {attempt} starts <script>alert(1)</script>"
        assert kept.lines[1].msg == f"from ctx.log, retry {attempt - 1}"
    shown = Ax(settings.database_url).ok("inspect", str(task_id), "--logs")
    assert "  #1: 2 lines" in shown and "  #2: 2 lines" in shown
    assert "WARNING  ax.task.t.runlog.flaky: from ctx.log, retry 1" in shown
    with TestClient(create_app(settings, None), base_url="http://127.0.0.1") as web:
        page = web.get(f"/tasks/{task_id}").text
    assert 'id="log-1"' in page and 'id="log-2"' in page
    assert "attempt 2 starts &lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script>alert(1)" not in page


def test_a_flood_is_bounded_and_a_concurrent_runs_lines_do_not_mix_in(
        settings: Settings, dispatch: Dispatch) -> None:
    flood = dispatch.enqueue("t.runlog.flood", {"tag": "flood", "lines": 1000, "width": 1000})
    quiet = dispatch.enqueue("t.runlog.flood", {"tag": "quiet", "lines": 30, "width": 10})
    with running(settings):
        _run(dispatch, [flood, quiet])
    engine = dispatch.client.store.engine
    big, small = logs_of(engine, flood)[1], logs_of(engine, quiet)[1]
    assert 0 < len(big.lines) <= settings.run_log_lines
    assert sum(line.size for line in big.lines) <= settings.run_log_bytes
    assert all(line.msg.startswith("flood ") for line in big.lines)
    numbers = [int(line.msg.split()[1]) for line in big.lines]
    assert numbers[0] == 0 and numbers[-1] == 999  # the first lines and the last
    assert big.cut is not None and big.cut.startswith(f"{1000 - len(big.lines)} lines (")
    assert small.cut is None and [line.msg for line in small.lines] == [
        f"quiet {i} {'x' * 10}" for i in range(30)]


def _count(engine: Any, table: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def test_archived_logs_still_show_and_purged_ones_are_gone(settings: Settings,
                                                           dispatch: Dispatch) -> None:
    engine = dispatch.client.store.engine
    archived = _retried_run(settings, dispatch)
    moved = archive_finished(engine, 0)
    assert moved.tasks == 1 and _count(engine, run_logs) == 0
    assert _count(engine, run_log_archive) == 2
    shown = Ax(settings.database_url).json("inspect", str(archived), "--logs")
    assert shown["archived"] is True and sorted(shown["logs"]) == ["1", "2"]
    assert shown["logs"]["2"]["lines"][1]["msg"] == "from ctx.log, retry 1"
    purged = dispatch.enqueue("t.runlog.flood", {"tag": "p", "lines": 3, "width": 1})
    with running(settings):
        _together.reset()
        threading.Thread(target=_together.wait, daemon=True).start()  # the flood's partner
        _run(dispatch, [purged])
    assert _count(engine, run_logs) == 1
    eventually(lambda: purge_finished(engine, Status.SUCCESS, 0).tasks == 1, what="purged")
    assert _count(engine, run_logs) == 0 and logs_of(engine, purged) == {}


def test_the_archive_file_holds_each_attempts_lines(settings: Settings, dispatch: Dispatch,
                                                    tmp_path: Path) -> None:
    engine = dispatch.client.store.engine
    task_id = _retried_run(settings, dispatch)
    assert archive_finished(engine, 0, to=tmp_path / "old.jsonl.gz").tasks == 1
    [line] = gzip.decompress((tmp_path / "old.jsonl.gz").read_bytes()).decode().splitlines()
    task = json.loads(line)
    assert task["task_id"] == task_id and [r["attempt"] for r in task["logs"]] == [1, 2]
    assert task["logs"][1]["lines"][1]["msg"] == "from ctx.log, retry 1"
    assert _count(engine, run_logs) == 0 and _count(engine, run_log_archive) == 0
