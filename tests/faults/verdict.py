"""A verdict: what one fault did to the tasks, judged from the ledger and the table —
lost, stuck, ran twice (and on which pid), published twice for one attempt, two runs at
once, started early, max lateness before, during and after the fault, later tasks run
exactly once — which of the issue's invariants it broke, and the session's summary table.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..ledger import Run


@dataclass
class Verdict:
    """What a fault did, judged from the ledger and the table."""

    fault: str
    tasks: int
    lost: list[int]
    never_ran: list[int]
    stuck: Counter[str]
    ran_twice: dict[int, list[Run]]
    #: of ran_twice: tasks RUNNING on a process when it was SIGKILLed (by the table right
    #: after the kill, or by a run of that process the ledger shows cut short)
    ran_twice_dead_pid: set[int]
    published_twice: list[tuple[int, int]]
    early: dict[int, int]
    late_before_ms: int | None
    late_during_ms: int | None
    late_after_ms: int | None
    later: int
    later_not_once: dict[int, int]
    overlapping: dict[int, list[Run]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    settled_s: float = 0.0
    #: ledger lines that did not parse (the instrument failed: the verdict is void)
    ledger_corrupt: int = 0

    # -- presentation ----------------------------------------------------------------------

    def row(self) -> list[str]:
        def ms(v: int | None) -> str:
            return "-" if v is None else f"{v / 1000:.2f} s"
        twice = f"{len(self.ran_twice)}"
        if self.ran_twice_dead_pid:
            twice += f" ({len(self.ran_twice_dead_pid)} RUNNING on a killed pid)"
        stuck = ", ".join(f"{s} {n}" for s, n in sorted(self.stuck.items())) or "0"
        return [self.fault, str(self.tasks), str(len(self.lost)), stuck, twice,
                str(len(self.published_twice)), str(len(self.overlapping)), str(len(self.early)),
                ms(self.late_during_ms), ms(self.late_after_ms),
                f"{self.later - len(self.later_not_once)}/{self.later}"]

    def describe(self, limit: int = 8) -> str:
        lines = [f"fault: {self.fault}: {self.tasks} tasks, settled after {self.settled_s:.1f} s"]
        lines.append(f"  lost (not SUCCESS): {len(self.lost)}; never ran: {len(self.never_ran)}; "
                     f"not final: {dict(self.stuck)}")
        if self.ran_twice:
            lines.append(f"  ran twice: {len(self.ran_twice)} "
                         f"({len(self.ran_twice_dead_pid)} were RUNNING on a process that was "
                         f"killed)")
            for task_id, runs in list(self.ran_twice.items())[:limit]:
                lines.append(f"    {task_id}: " + "; ".join(r.brief() for r in runs))
        if self.published_twice:
            lines.append(f"  published twice for one attempt: {self.published_twice[:limit]}")
        if self.overlapping:
            lines.append(f"  two runs at once: {len(self.overlapping)}")
            for task_id, runs in list(self.overlapping.items())[:limit]:
                lines.append(f"    {task_id}: " + "; ".join(r.brief() for r in runs))
        if self.early:
            worst = sorted(self.early.items(), key=lambda kv: -kv[1])[:limit]
            lines.append(f"  started early: {len(self.early)}, ms early: {worst}")
        lines.append(f"  max lateness before / during / after the fault: "
                     f"{self.late_before_ms} / {self.late_during_ms} / {self.late_after_ms} ms")
        lines.append(f"  later tasks run exactly once: {self.later - len(self.later_not_once)}"
                     f" of {self.later}" + (f"; not once (runs): "
                                           f"{list(self.later_not_once.items())[:limit]}"
                                           if self.later_not_once else ""))
        lines += [f"  {k}: {v}" for k, v in self.extra.items()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    # -- invariants --------------------------------------------------------------------------

    def problems(self, *, allow_twice_on_killed_pid: bool = False,
                 max_late_after_ms: int | None = None) -> list[str]:
        """The issue's invariants this fault broke (empty: none broken); lateness after the
        fault is judged only when ``max_late_after_ms`` is given."""
        found = []
        if self.ledger_corrupt:
            found.append(f"the ledger has {self.ledger_corrupt} unreadable lines")
        if self.lost:
            found.append(f"{len(self.lost)} of {self.tasks} tasks lost (not SUCCESS: "
                         f"{dict(self.stuck) or 'final but failed'}; {len(self.never_ran)} never "
                         f"ran)")
        allowed = self.ran_twice_dead_pid if allow_twice_on_killed_pid else set()
        unexplained = set(self.ran_twice) - allowed
        if unexplained:
            found.append(f"{len(unexplained)} tasks ran twice without having been RUNNING on a "
                         f"killed process, e.g. {sorted(unexplained)[:5]}")
        if self.published_twice:
            found.append(f"{len(self.published_twice)} (task, attempt) ran twice")
        if self.overlapping:
            found.append(f"{len(self.overlapping)} tasks had two runs at once")
        if self.early:
            found.append(f"{len(self.early)} tasks started before their trigger time "
                         f"(up to {max(self.early.values())} ms early)")
        if self.later_not_once:
            found.append(f"{len(self.later_not_once)} of {self.later} tasks enqueued after the "
                         f"fault did not run exactly once")
        if (max_late_after_ms is not None and self.late_after_ms is not None
                and self.late_after_ms > max_late_after_ms):
            found.append(f"tasks due after the fault ran up to {self.late_after_ms} ms late "
                         f"(> {max_late_after_ms} ms)")
        return found


HEADER = ["fault", "tasks", "lost", "stuck (not final)", "ran twice", "pub. twice / attempt",
          "2 runs at once", "early", "max late during", "max late after", "later ran once"]


def table(verdicts: Sequence[Verdict]) -> str:
    """The summary table, as Markdown."""
    return rows_table([v.row() for v in verdicts])


def rows_table(lines: Sequence[Sequence[str]]) -> str:
    """The summary table of verdict rows (:meth:`Verdict.row`), as Markdown."""
    rows = [HEADER] + [list(line) for line in lines]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    fmt = [("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
           for r in rows]
    fmt.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(fmt)

