"""A run's log buffer keeps its first lines and its last few within both bounds, and says
what it cut (ax_kombu.core.run_log); the capture keeps only the current run's records."""

from __future__ import annotations

import logging
import threading

import pytest

from ax_kombu.core.run_log import LINE_OVERHEAD, LogLine, RunLogBuffer, capped, line_cap, tail_size
from ax_kombu.worker.runlog import RunLogScope, install
from ax_kombu.worker.task import RunTask


def _line(i: int, msg: str | None = None) -> LogLine:
    return LogLine(1_000 + i, "INFO", "t", msg if msg is not None else f"line {i}")


def _fill(buffer: RunLogBuffer, count: int, msg: str | None = None) -> None:
    for i in range(count):
        buffer.add(_line(i, msg))


def test_nothing_logged_is_no_log() -> None:
    assert RunLogBuffer(200, 65536).snapshot() is None


def test_within_the_bounds_every_line_is_kept_in_order() -> None:
    buffer = RunLogBuffer(200, 65536)
    _fill(buffer, 200)
    log = buffer.snapshot()
    assert log is not None and log.cut is None
    assert [line.msg for line in log.lines] == [f"line {i}" for i in range(200)]


def test_past_the_line_bound_the_first_and_the_last_lines_are_kept() -> None:
    buffer = RunLogBuffer(200, 1 << 20)
    _fill(buffer, 1000)
    log = buffer.snapshot()
    assert log is not None and len(log.lines) == 200
    kept = [int(line.msg.split()[1]) for line in log.lines]
    assert kept == list(range(180)) + list(range(980, 1000))
    assert log.cut is not None and log.cut.startswith("800 lines (") and "after line 180" in log.cut


def test_past_the_byte_bound_the_log_fits_it() -> None:
    buffer = RunLogBuffer(200, 65536)
    _fill(buffer, 1000, "x" * 1000)  # 1 MiB in all
    log = buffer.snapshot()
    assert log is not None and log.cut is not None
    assert sum(line.size for line in log.lines) <= 65536
    assert log.lines[0].t == 1_000 and log.lines[-1].t == 1_999  # first and last kept
    assert f"{1000 - len(log.lines)} lines (" in log.cut and "KiB) cut" in log.cut


def test_the_bounds_cap_a_line_and_size_the_tail() -> None:
    assert line_cap(65536) == 4096 and line_cap(4096) == 1024
    assert tail_size(200) == 20 and tail_size(8) == 2 and tail_size(1) == 1
    assert capped("abcdef", 4) == "abcd… (2 characters cut)" and capped("abc", 4) == "abc"
    assert _line(0, "é").size == 2 + 1 + LINE_OVERHEAD


def _task(task_id: int) -> RunTask:
    return RunTask(task_id=task_id, attempt=1, task_type="t", payload=None, trace_id="x",
                   trigger_time=0, timeout_ms=1000, priority="default", retry_count=0,
                   max_retry=0, processor="t", callback_url=None, dispatched_at=0, node="n")


def test_the_capture_keeps_the_current_runs_records_only() -> None:
    install()
    logger = logging.getLogger("ax.test.capture")
    logger.setLevel(logging.INFO)
    scope = RunLogScope(200, 65536)
    tasks = [_task(1), _task(2)]
    ready = threading.Barrier(2)

    def run(task: RunTask) -> None:
        with scope(task, None):  # type: ignore[arg-type]  # the capture reads no context
            ready.wait(5)
            for i in range(50):
                logger.info("run %d line %d", task.task_id, i)
            try:
                raise ValueError("boom")
            except ValueError:
                logger.exception("failed")

    threads = [threading.Thread(target=run, args=(t,)) for t in tasks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    logger.info("outside any run")
    for task in tasks:
        assert task.logs is not None
        log = task.logs.snapshot()
        assert log is not None and len(log.lines) == 51
        assert all(f"run {task.task_id} " in line.msg for line in log.lines[:50])
        assert log.lines[-1].level == "ERROR" and "ValueError: boom" in log.lines[-1].msg


@pytest.mark.parametrize("lines, size", [(0, 65536), (200, 0)])
def test_a_zero_bound_turns_the_capture_off(lines: int, size: int) -> None:
    from ax_kombu.config import from_env
    from ax_kombu.worker.runlog import run_log_scope

    assert run_log_scope(from_env({}, run_log_lines=lines, run_log_bytes=size)) == []


@pytest.mark.parametrize("name, value", [("run_log_lines", -1), ("run_log_bytes", 100),
                                         ("run_log_bytes", 1 << 30)])
def test_bad_bounds_are_refused(name: str, value: int) -> None:
    from ax_kombu.config import from_env
    from ax_kombu.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError, match=name):
        from_env({f"AX_{name.upper()}": str(value)})
