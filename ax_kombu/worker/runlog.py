"""Each run's own log lines: what a run logs is kept with its attempt.

**What is captured.** Every record that reaches the root logger (a logger's level and
the logging configuration still decide what is emitted: the worker logs at ``INFO`` unless
told otherwise) while a run is *current* in the emitting thread or asyncio task: the
processor's own ``logging.getLogger(…)`` calls, ``ctx.log``, and anything the libraries
it calls log. "Current" is a :class:`~contextvars.ContextVar` set by the run scope
(:func:`run_log_scope`) around the processor call, so it is right for a pool thread
(set for its run, reset after) and for an ``async def`` processor (the scopes are entered
inside the run's own asyncio task; tasks it creates inherit it). **Not captured:** records
of threads the processor starts itself (a new ``threading.Thread`` starts with an empty
context), unless it runs them in a copy of its context (``contextvars.copy_context()``;
``asyncio.to_thread`` does that).

**Bounds** (``run_log_lines`` / ``AX_RUN_LOG_LINES``, ``run_log_bytes`` /
``AX_RUN_LOG_BYTES``; 0 in either keeps none): the run's first lines and its last few,
with a note of what was cut between them (:mod:`ax_kombu.core.run_log`). A line is its
time, level name, logger name and formatted message, then its exception's traceback when
it was logged with one (capped).

**Cost.** A run that logs nothing costs the scope object and the variable's set and
reset; the buffer is made on its first record. Records logged when no run is current
return from :meth:`RunLogHandler.handle` after one variable read, without the handler's
lock.

**Where the lines go.** The buffer is the run's :attr:`RunTask.logs
<ax_kombu.worker.task.RunTask.logs>`; the result writer stores what it holds when it
writes the run's end, in the same transaction (:mod:`ax_kombu.store.run_logs`). A run
whose timeout passed is recorded while its thread may still be running: what it logs
after that is not kept.
"""

from __future__ import annotations

import logging
import threading
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Self

from ax_kombu.config import Settings
from ax_kombu.core.context import Context
from ax_kombu.core.run_log import LogLine, RunLogBuffer, capped, line_cap
from ax_kombu.worker.task import RunTask

#: the capture of the run current in this thread or asyncio task (None: no run)
_current: ContextVar[_Capture | None] = ContextVar("ax_run_log", default=None)
_install_lock = threading.Lock()
_formatter = logging.Formatter()


class RunLogHandler(logging.Handler):
    """Keeps each record emitted while a run is current in that run's buffer (installed
    once per process on the root logger: :func:`install`)."""

    def handle(self, record: logging.LogRecord) -> bool:
        """Keep ``record`` if a run is current (no handler lock: each buffer has its own)."""
        capture = _current.get()
        if capture is None:
            return False
        try:
            capture.add(record)
        except Exception:  # noqa: BLE001 - a record that cannot be formatted: logging reports it
            self.handleError(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        self.handle(record)


_handler = RunLogHandler()


def install() -> None:
    """Put the capture's handler on the root logger, once per process (idempotent)."""
    root = logging.getLogger()
    with _install_lock:
        if _handler not in root.handlers:
            root.addHandler(_handler)


def uninstall() -> None:
    """Take the capture's handler off the root logger (nothing is captured after)."""
    logging.getLogger().removeHandler(_handler)


class _Capture:
    """One run's capture: the scope around its processor call, and where its records go."""

    __slots__ = ("_token", "max_bytes", "max_lines", "task")

    def __init__(self, task: RunTask, max_lines: int, max_bytes: int) -> None:
        self.task = task
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self._token: Token[_Capture | None] | None = None

    def __enter__(self) -> Self:
        self._token = _current.set(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None

    def add(self, record: logging.LogRecord) -> None:
        """Keep ``record`` as a line of this run (within its bounds)."""
        buffer = self.task.logs
        if buffer is None:
            with _install_lock:  # its first record may come from two threads at once
                buffer = self.task.logs
                if buffer is None:
                    buffer = self.task.logs = RunLogBuffer(self.max_lines, self.max_bytes)
        limit = line_cap(self.max_bytes)
        text = capped(record.getMessage(), limit)
        if record.exc_info:
            trace = _formatter.formatException(record.exc_info)
            text = capped(f"{text}\n{trace}", limit)
        buffer.add(LogLine(int(record.created * 1000), record.levelname, record.name, text))


class RunLogScope:
    """The run scope that captures each run's log lines (see the module docstring)."""

    __slots__ = ("max_bytes", "max_lines")

    def __init__(self, max_lines: int, max_bytes: int) -> None:
        self.max_lines = max_lines
        self.max_bytes = max_bytes

    def __call__(self, task: RunTask, ctx: Context) -> _Capture:
        return _Capture(task, self.max_lines, self.max_bytes)


def run_log_scope(settings: Settings) -> list[RunLogScope]:
    """The capture's scope for a worker with ``settings`` (none when its bounds are 0),
    its handler installed on the root logger."""
    if not (settings.run_log_lines and settings.run_log_bytes):
        return []
    install()
    return [RunLogScope(settings.run_log_lines, settings.run_log_bytes)]
