"""A run's own log lines, bounded: :class:`RunLogBuffer` keeps what one run logged, and
:class:`RunLog` is what is stored for its attempt (``ax_run_log``). Pure (no I/O, no
``logging``): the worker's capture (:mod:`ax_kombu.worker.runlog`) turns log records into
:class:`LogLine`\\ s.

Bounds (``run_log_lines`` lines and ``run_log_bytes`` bytes per run):

* each line's text (message, then the traceback if any) is capped at
  :func:`line_cap` characters, with a note of how much of it was cut;
* while both bounds hold, every line is kept; from the first line that would pass
  either, the buffer keeps only the **last** :func:`tail_size` lines (a ring), and
  counts the rest. When it is read (:meth:`RunLogBuffer.snapshot`) the first lines are
  trimmed from their end until first + last fit both bounds again, so a stored log
  holds the run's **first lines and its last few**, and :attr:`RunLog.cut` says what
  is missing between them: ``"137 lines (80 KiB) cut after line 180"``.

A line's size is the UTF-8 length of its message and logger name plus a fixed
:data:`LINE_OVERHEAD` for its other fields: close to its stored JSON, cheap to count.
Memory per run stays within the bounds (plus one ring of capped lines).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, NamedTuple

#: the stored JSON of a line, besides its message and logger name (keys, time, level)
LINE_OVERHEAD = 48
#: the longest text of one line, in characters (smaller when the byte bound is small)
LINE_MAX = 4096
#: the most lines kept from the end of a run that passed its bounds
TAIL_MAX = 20


def line_cap(max_bytes: int) -> int:
    """The most characters of one line's text under a byte bound of ``max_bytes``: a
    quarter of it, at most :data:`LINE_MAX`, so one line never fills a run's log."""
    return max(16, min(LINE_MAX, max_bytes // 4))


def tail_size(max_lines: int) -> int:
    """How many of a run's last lines are kept once it passed its bounds."""
    return max(1, min(TAIL_MAX, max_lines // 4))


def capped(text: str, limit: int) -> str:
    """``text``, cut to ``limit`` characters with a note of how many were cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} characters cut)"


def size_text(size: int) -> str:
    """A byte count as people read it: ``512 B``, ``80 KiB``, ``1.5 MiB``."""
    if size < 1024:
        return f"{size} B"
    if size < 1024 * 1024:
        return f"{size / 1024:.0f} KiB"
    return f"{size / (1024 * 1024):.1f} MiB"


class LogLine(NamedTuple):
    """One kept log record."""

    #: when it was logged, epoch ms
    t: int
    #: its level name (``INFO``, ``ERROR``…)
    level: str
    #: the logger's name
    logger: str
    #: the formatted message, then the exception's traceback if it had one (capped)
    msg: str

    @property
    def size(self) -> int:
        """Its size as the bounds count it (see the module docstring)."""
        return len(self.msg.encode("utf-8", "replace")) + len(self.logger) + LINE_OVERHEAD

    def as_json(self) -> dict[str, Any]:
        """The small object stored for it."""
        return {"t": self.t, "level": self.level, "logger": self.logger, "msg": self.msg}

    @classmethod
    def from_json(cls, item: dict[str, Any]) -> LogLine:
        """The line stored as ``item`` (:meth:`as_json`)."""
        return cls(int(item["t"]), str(item["level"]), str(item["logger"]), str(item["msg"]))


class RunLog(NamedTuple):
    """What one attempt logged, as stored: its kept lines, oldest first, and what was cut
    (None: nothing)."""

    lines: tuple[LogLine, ...]
    cut: str | None = None


class RunLogBuffer:
    """The lines one run logs, within ``max_lines`` and ``max_bytes`` (module docstring).

    Thread-safe: a run's records may come from threads it started with its context (say
    ``asyncio.to_thread``). Made on a run's first record, so a run that logs nothing
    costs none.
    """

    __slots__ = (
        "_head",
        "_head_bytes",
        "_lock",
        "_seen",
        "_seen_bytes",
        "_tail",
        "max_bytes",
        "max_lines",
    )

    def __init__(self, max_lines: int, max_bytes: int) -> None:
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._head: list[LogLine] = []
        self._head_bytes = 0
        self._tail: deque[LogLine] = deque(maxlen=tail_size(max_lines))
        self._seen = 0
        self._seen_bytes = 0

    def add(self, line: LogLine) -> None:
        """Keep ``line`` (its text already capped: :func:`line_cap`) if the bounds allow."""
        size = line.size
        with self._lock:
            self._seen += 1
            self._seen_bytes += size
            if (not self._tail and len(self._head) < self.max_lines
                    and self._head_bytes + size <= self.max_bytes):
                self._head.append(line)
                self._head_bytes += size
            else:
                self._tail.append(line)

    def snapshot(self) -> RunLog | None:
        """What is kept so far, within the bounds, with the note of what was cut; None
        if nothing was logged."""
        with self._lock:
            if not self._seen:
                return None
            head, tail = list(self._head), list(self._tail)
            seen, seen_bytes = self._seen, self._seen_bytes
        if not tail:
            return RunLog(tuple(head))
        head_bytes = sum(line.size for line in head)
        tail_bytes = sum(line.size for line in tail)
        while head and (len(head) + len(tail) > self.max_lines
                        or head_bytes + tail_bytes > self.max_bytes):
            head_bytes -= head.pop().size
        while tail and head_bytes + tail_bytes > self.max_bytes:
            tail_bytes -= tail.pop(0).size
        cut_lines = seen - len(head) - len(tail)
        cut_bytes = seen_bytes - head_bytes - tail_bytes
        note = f"{cut_lines} lines ({size_text(cut_bytes)}) cut after line {len(head)}"
        return RunLog(tuple(head + tail), note)
