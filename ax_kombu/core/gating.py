"""Which due tasks may start now: ordered keys, cluster-wide limits, job strategies — pure,
no I/O. The gated claim (:mod:`ax_kombu.store.gates`) reads the state of the store, asks
:func:`decide`, and writes the answer in the same transaction.

A task is *gated* when it has a ``gate`` (an order key, or an occurrence of a job whose
strategy is ``discard`` or ``cover``) or its type has a limit. For each due gated task,
in trigger order (ties by id):

* **order key** (``gate`` ``order`` / ``order_skip``; also serial jobs, whose occurrences
  share the key ``ax.job:<name>``): it starts only if no task of its key is DISPATCHING or
  RUNNING and it is the key's head — the first waiting task of the key by
  ``(order_seq, task_id)``. A task waiting for a retry keeps its place (it is the head),
  unless its gate is ``order_skip`` (``order_policy="skip_failed"``): then it gives its
  place up until its retry is due. Otherwise it **waits** (parked, READY).
* **limit**: at most ``limit`` tasks of the type DISPATCHING or RUNNING; over it, it
  **waits**.
* **discard** (a job's occurrence): if an earlier occurrence of the job is unfinished,
  it is **cancelled** with the reason.
* **cover** (a job's occurrence): every earlier unfinished occurrence is **superseded**
  (cancelled, a running one signalled), and it starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: the key of a serial job's occurrences
SERIAL_PREFIX = "ax.job:"
ORDER_GATES = frozenset({"order", "order_skip"})


@dataclass(frozen=True)
class Candidate:
    """A due task the gated claim considers."""

    task_id: int
    task_type: str
    trigger_time: int
    gate: str | None = None
    order_key: str | None = None
    job: str | None = None
    scheduled_at: int | None = None


@dataclass(frozen=True)
class Running:
    """What the store says is in progress, for the keys, types and jobs of the candidates.

    Attributes:
        limits: task type → its limit (types without one are absent).
        active: task type → tasks DISPATCHING or RUNNING.
        busy_keys: order keys with a task DISPATCHING or RUNNING.
        heads: order key → the task id first in line among its waiting tasks.
        unfinished: job → ``(task_id, scheduled_at)`` of its occurrences not finished
            (waiting, DISPATCHING or RUNNING).
    """

    limits: Mapping[str, int] = field(default_factory=dict)
    active: Mapping[str, int] = field(default_factory=dict)
    busy_keys: frozenset[str] = frozenset()
    heads: Mapping[str, int] = field(default_factory=dict)
    unfinished: Mapping[str, Sequence[tuple[int, int]]] = field(default_factory=dict)


@dataclass
class Decision:
    """What the gated claim does with its candidates.

    Attributes:
        start: ids to claim now.
        wait: ids to park until a run of their key or type ends.
        cancel: ``(task_id, reason)`` of candidates dropped (discard).
        supersede: ``(task_id, reason)`` of earlier occurrences replaced (cover).
    """

    start: list[int] = field(default_factory=list)
    wait: list[int] = field(default_factory=list)
    cancel: list[tuple[int, str]] = field(default_factory=list)
    supersede: list[tuple[int, str]] = field(default_factory=list)


def decide(candidates: Sequence[Candidate], running: Running) -> Decision:
    """Decide each candidate, in trigger order (ties by id); see the module docstring."""
    batch = _Batch(running)
    for c in sorted(candidates, key=lambda c: (c.trigger_time, c.task_id)):
        batch.consider(c)
    return batch.result


class _Batch:
    """The candidates decided so far, and what starting them changed."""

    def __init__(self, running: Running) -> None:
        self.running = running
        self.result = Decision()
        self.active = dict(running.active)
        self.busy = set(running.busy_keys)
        self.taken: dict[str, Candidate] = {}  # job → its occurrence started in this batch
        self.superseded: set[int] = set()

    def consider(self, c: Candidate) -> None:
        if c.task_id in self.superseded:
            return
        if self._must_wait(c):
            self.result.wait.append(c.task_id)
            return
        if c.gate == "discard" and c.job is not None:
            earlier = self._unfinished_before(c)
            if earlier:
                reason = (f"discarded: occurrence of job {c.job!r} while task {earlier[0]} "
                          "of it was unfinished")
                self.result.cancel.append((c.task_id, reason))
                return
        if c.gate == "cover" and c.job is not None:
            self._supersede(c)
        self._start(c)

    def _must_wait(self, c: Candidate) -> bool:
        if c.gate in ORDER_GATES and c.order_key is not None and (
                c.order_key in self.busy
                or self.running.heads.get(c.order_key, c.task_id) != c.task_id):
            return True
        limit = self.running.limits.get(c.task_type)
        return limit is not None and self.active.get(c.task_type, 0) >= limit

    def _unfinished_before(self, c: Candidate) -> list[int]:
        """Occurrences of ``c``'s job before it and not finished (started here included)."""
        assert c.job is not None
        found = [task_id for task_id, scheduled_at in self.running.unfinished.get(c.job, ())
                 if task_id != c.task_id and scheduled_at < (c.scheduled_at or 0)
                 and task_id not in self.superseded]
        started = self.taken.get(c.job)
        if started is not None and started.task_id not in found:
            found.append(started.task_id)
        return found

    def _supersede(self, c: Candidate) -> None:
        for task_id in self._unfinished_before(c):
            self.superseded.add(task_id)
            if task_id in self.result.wait:  # waiting in this batch: superseded instead
                self.result.wait.remove(task_id)
            reason = f"superseded by task {c.task_id}, a later occurrence of job {c.job!r}"
            self.result.supersede.append((task_id, reason))
            started = self.taken.get(c.job or "")
            if started is not None and started.task_id == task_id:  # started in this batch
                self.result.start.remove(task_id)
                self.active[started.task_type] -= 1

    def _start(self, c: Candidate) -> None:
        self.result.start.append(c.task_id)
        self.active[c.task_type] = self.active.get(c.task_type, 0) + 1
        if c.gate in ORDER_GATES and c.order_key is not None:
            self.busy.add(c.order_key)
        if c.job is not None:
            self.taken[c.job] = c
