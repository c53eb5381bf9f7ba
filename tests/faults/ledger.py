"""The ledger: what the ``fault.task`` processor (:mod:`tests.faults.fault_tasks`) wrote,
one start and one end line per run, read back as :class:`Run` records.

A run that started and never ended was cut short (its process was killed mid-run).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Run:
    """One processor run, as ``fault.task`` recorded it (``end`` None: never returned)."""

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


class Ledger:
    """The file every ``fault.task`` run appends to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        #: lines of the last read that did not parse
        self.corrupt: list[bytes] = []

    def lines(self) -> int:
        try:
            with open(self.path, "rb") as f:
                return sum(1 for _ in f)
        except FileNotFoundError:
            return 0

    def runs(self) -> list[Run]:
        """Every run so far. A last line still being written (no newline yet) is left for
        the next read; a line that does not parse is kept in :attr:`corrupt`."""
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
                          d["node"], d["pid"], d["t"])
                runs.append(run)
                open_runs[key].append(run)
            elif open_runs[key]:
                open_runs[key].pop(0).end = d["t"]
        return runs

    def by_task(self) -> dict[int, list[Run]]:
        out: dict[int, list[Run]] = defaultdict(list)
        for run in self.runs():
            out[run.task_id].append(run)
        for runs in out.values():
            runs.sort(key=lambda r: r.start)
        return dict(out)

