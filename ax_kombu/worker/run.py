"""A run: one received message of one task's attempt on this worker, with ONE state.

Pure (no I/O, no lock): the states, the legal moves between them, and :class:`Run`, whose
:meth:`Run.move` is the only way its state changes. Who moves a run, and under which
lock, is the intake's business (:mod:`ax_kombu.worker.intake`); this module only refuses
a move the table does not allow (:class:`IllegalMove`), so a run can never be, say,
started after it was withdrawn, or acked twice.

The main line::

    RECEIVED → PLANNED → FENCED → STAGED ⇄ LISTED
                                   STAGED → STARTED → ENDED → DURABLE → SETTLED

* ``RECEIVED``: taken from the broker, waiting to be planned (or in its lane's backlog);
* ``PLANNED``: in a receipt batch, its lane's room reserved for it;
* ``FENCED``: its RUNNING move committed (fenced by attempt and live incarnation): from
  here on its task is the row's, not the message's;
* ``STAGED``: in its pool, waiting for a thread or for its trigger time;
* ``LISTED``: staged, and written (or about to be) in the node row's ``listed_runs``; it
  goes back to ``STAGED`` only once released (:mod:`ax_kombu.worker.listing`);
* ``STARTED``: its processor was called;
* ``ENDED``: its outcome is with the result writer;
* ``DURABLE``: its outcome is committed (or found to move nothing);
* ``SETTLED``: done with: its message acked (or void: its connection is gone).

The side exits, each a reason the run ends without an outcome of its own:

* ``HANDED_BACK``: received, no lane took it: DISPATCHING → READY, then settled;
* ``REFUSED``: a duplicate delivery, or its RUNNING move was refused (stale, cancelled,
  fenced out): settled (acked), never run;
* ``RETURNED``: received and not fenced when its connection was lost, or rejected with
  requeue: the broker has the message again (final);
* ``WITHDRAWN``: staged and taken back (a stop, or the node declared dead): whoever
  withdrew it writes its row back; settled;
* ``CANCELLED``: staged when its cancellation signal was set (``ax cancel``, or its
  timeout passed before it could start): never started; settled;
* ``ABANDONED``: staged when its pool closed or gave it up: its row stays RUNNING for the
  recovery; settled.

A run's message is acked at most once: when the run is SETTLED, or earlier for a run
that must not keep its message (a task allowed longer than RabbitMQ keeps a message
unacked, or a connection lost). The ack drops the run's ``message``
(:mod:`ax_kombu.worker.acks`): the message's side, not a second state of the run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.core.context import Cancellation
from ax_kombu.worker.task import RunTask


class State(enum.IntEnum):
    """Where a run is; see the module docstring. An int (its index in the table): a move is
    checked on every run several times, and an int hashes in C where an Enum's hash is a
    Python call."""

    RECEIVED = 0
    PLANNED = 1
    FENCED = 2
    STAGED = 3
    LISTED = 4
    STARTED = 5
    ENDED = 6
    DURABLE = 7
    SETTLED = 8
    HANDED_BACK = 9
    REFUSED = 10
    RETURNED = 11
    WITHDRAWN = 12
    CANCELLED = 13
    ABANDONED = 14


S = State

#: every legal move: from a state to each state it may go to next
MOVES: dict[State, frozenset[State]] = {
    S.RECEIVED: frozenset({S.PLANNED, S.HANDED_BACK, S.REFUSED, S.RETURNED}),
    S.PLANNED: frozenset({S.FENCED, S.REFUSED, S.HANDED_BACK, S.RETURNED}),
    S.FENCED: frozenset({S.STAGED}),
    S.STAGED: frozenset({S.LISTED, S.STARTED, S.WITHDRAWN, S.CANCELLED, S.ABANDONED}),
    S.LISTED: frozenset({S.STAGED, S.WITHDRAWN, S.CANCELLED, S.ABANDONED}),
    S.STARTED: frozenset({S.ENDED}),
    S.ENDED: frozenset({S.DURABLE}),
    S.DURABLE: frozenset({S.SETTLED}),
    S.HANDED_BACK: frozenset({S.SETTLED}),
    S.REFUSED: frozenset({S.SETTLED}),
    S.WITHDRAWN: frozenset({S.SETTLED}),
    S.CANCELLED: frozenset({S.SETTLED}),
    S.ABANDONED: frozenset({S.SETTLED}),
    S.SETTLED: frozenset(),
    S.RETURNED: frozenset(),
}

#: the table by state (a State is its own index)
_ALLOWED: tuple[frozenset[State], ...] = tuple(MOVES[state] for state in State)

#: a run in one of these is in its pool and has not started (the stage)
WAITING = frozenset({S.STAGED, S.LISTED})


class IllegalMove(Exception):
    """A move the table (:data:`MOVES`) does not allow: a bug in whoever asked for it."""


class Withdrawn(Exception):
    """A staged run ended before its trigger time without starting: cancelled (``ax
    cancel``; the row is CANCELLED) or withdrawn by a stopping worker (which writes the
    row back itself). Nothing is recorded for it."""


L = TypeVar("L")


@dataclass(eq=False, slots=True, kw_only=True)
class Run(Generic[L]):
    """One received message and the run it asks for, in one :class:`State`.

    ``L`` is the lane's type (:class:`ax_kombu.worker.lanes.Lane`): this module names no
    lane, so that it stays below the modules that move runs.
    """

    lane: L
    #: the message's task until the RUNNING move, then the task as its row stores it
    task: TaskMessage | RunTask
    #: the broker message until it is acked (then None: acked at most once)
    message: Any
    #: which broker connection it came on (acks are only valid there)
    generation: int
    state: State = S.RECEIVED
    #: the run's cancellation signal, once it is in its pool
    cancel: Cancellation | None = None
    #: the worker incarnation its RUNNING move was fenced under
    incarnation: int = 0
    #: its place in its pool's take order once submitted: its trigger time on the executor's
    #: clock (past for a run due already) and its submission number — a thread takes the
    #: smallest first, and the listing's scan reads the stage in that order
    order: tuple[float, int] = (0.0, 0)

    def move(self, to: State) -> None:
        """Move to ``to``.

        Raises:
            IllegalMove: the table does not allow that move from the current state.
        """
        if to not in _ALLOWED[self.state]:
            raise IllegalMove(f"run of task {self.task.task_id}: {self.state.name} → {to.name}")
        self.state = to

    @property
    def acked(self) -> bool:
        """Its message was acked (or will never be: its connection is gone)."""
        return self.message is None

    @property
    def pair(self) -> tuple[int, int]:
        return self.task.task_id, self.task.attempt

    @property
    def labels(self) -> dict[str, Any]:
        return {"task_id": self.task.task_id, "trace_id": self.task.trace_id,
                "attempt": self.task.attempt}
