"""The run ledger: what a test processor really ran, one start and one end line per run,
written by the processor in the worker process and read back by the test as :class:`Run`
records. The end-to-end tasks (:mod:`tests.e2e.e2e_tasks`) and the fault suite's
(:mod:`tests.faults.fault_tasks`) both write it.

A line is one JSON object, appended with ``O_APPEND`` and one ``write`` (far below
``PIPE_BUF``), so lines of several processes and threads never interleave:

* ``{"ev": "start", ...}`` *before the processor does anything else*: task id, attempt,
  retry_count, the message's trigger time, the producer's planned trigger time (if it gave
  one), the node name (if the worker was told it), pid, start epoch ms;
* ``{"ev": "end", ...}`` when the processor body returns or raises. A process killed
  mid-run never writes it, so "started, never ended" marks a run cut short.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Run:
    """One processor run, as the processor recorded it (``end`` None: never returned)."""

    task_id: int
    attempt: int
    retry: int
    trigger: int
    planned: int | None
    node: str
    pid: int
    start: int
    end: int | None = None

    def brief(self) -> str:
        ended = "never ended" if self.end is None else f"{self.end - self.start} ms"
        return f"attempt {self.attempt} on {self.node} pid {self.pid} at {self.start} ({ended})"


def _append(path: str, record: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
    finally:
        os.close(fd)


@contextmanager
def recording(path: str, ctx: Any, planned: int | None = None, node: str = "") -> Iterator[None]:
    """Write the start line of the run ``ctx`` (a processor's context) to ``path`` now, and
    its end line when the ``with`` block is left, by a return or an exception."""
    run = {"id": ctx.task_id, "attempt": ctx.attempt, "pid": os.getpid()}
    _append(path, {"ev": "start", **run, "retry": ctx.retry_count, "trigger": ctx.trigger_time,
                   "planned": planned, "node": node, "t": time.time_ns() // 1_000_000})
    try:
        yield
    finally:
        _append(path, {"ev": "end", **run, "t": time.time_ns() // 1_000_000})


class Ledger:
    """The ledger file the processors of a test append to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        #: lines of the last read that did not parse
        self.corrupt: list[bytes] = []

    def __str__(self) -> str:
        return str(self.path)

    def lines(self) -> int:
        try:
            with open(self.path, "rb") as f:
                return sum(1 for _ in f)
        except FileNotFoundError:
            return 0

    def runs(self) -> list[Run]:
        """Every run so far, in the order they started. A last line still being written (no
        newline yet) is left for the next read; a line that does not parse is kept in
        :attr:`corrupt`."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        runs: list[Run] = []
        open_runs: dict[tuple[int, int, int], list[Run]] = defaultdict(list)
        self.corrupt = []
        for line in data.split(b"\n")[:-1]:
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except ValueError:
                self.corrupt.append(line)
                continue
            key = (d["id"], d["attempt"], d["pid"])
            if d["ev"] == "start":
                run = Run(d["id"], d["attempt"], d["retry"], d["trigger"], d.get("planned"),
                          d.get("node") or "", d["pid"], d["t"])
                runs.append(run)
                open_runs[key].append(run)
            elif open_runs[key]:
                open_runs[key].pop(0).end = d["t"]
        return runs

    def by_task(self) -> dict[int, list[Run]]:
        """Each task's runs, in the order they started."""
        out: dict[int, list[Run]] = defaultdict(list)
        for run in self.runs():
            out[run.task_id].append(run)
        for runs in out.values():
            runs.sort(key=lambda r: r.start)
        return dict(out)
