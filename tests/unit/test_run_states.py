"""The run's state machine (:mod:`ax_kombu.worker.run`) as a table: every legal move succeeds,
every other (from, to) pair is refused and leaves the state as it was."""

from __future__ import annotations

import itertools

import pytest

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.worker.run import MOVES, IllegalMove, Run, State

TASK = TaskMessage(task_id=1, attempt=1, task_type="t", payload={}, trace_id="tr",
                   trigger_time=0, timeout_ms=1000, priority="default", retry_count=0,
                   max_retry=0, processor="p", callback_url=None, dispatched_at=0, node="s")

LEGAL = sorted(((a, b) for a, targets in MOVES.items() for b in targets),
               key=lambda pair: (pair[0], pair[1]))
ILLEGAL = sorted(((a, b) for a, b in itertools.product(State, State) if b not in MOVES[a]),
                 key=lambda pair: (pair[0], pair[1]))


def run_in(state: State) -> Run[None]:
    return Run(lane=None, task=TASK, message=object(), generation=1, state=state)


def test_the_table_names_every_state_and_each_state_is_its_index() -> None:
    assert set(MOVES) == set(State)
    assert [int(s) for s in State] == list(range(len(State)))


@pytest.mark.parametrize(("start", "to"), LEGAL, ids=lambda s: s.name)
def test_every_legal_move_succeeds(start: State, to: State) -> None:
    run = run_in(start)
    run.move(to)
    assert run.state is to


@pytest.mark.parametrize(("start", "to"), ILLEGAL, ids=lambda s: s.name)
def test_every_illegal_move_is_refused(start: State, to: State) -> None:
    run = run_in(start)
    with pytest.raises(IllegalMove):
        run.move(to)
    assert run.state is start


def test_the_main_line_is_a_path_through_the_table() -> None:
    run = run_in(State.RECEIVED)
    for state in (State.PLANNED, State.FENCED, State.STAGED, State.LISTED, State.STAGED,
                  State.STARTED, State.ENDED, State.DURABLE, State.SETTLED):
        run.move(state)
    assert run.state is State.SETTLED and not MOVES[State.SETTLED]


def test_every_state_but_the_final_ones_leads_to_settled_or_returned() -> None:
    finals = {State.SETTLED, State.RETURNED}
    for state in State:
        seen, todo = {state}, [state]
        while todo:
            for nxt in MOVES[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert seen & finals, state


def test_a_new_run_is_received_and_its_ack_is_its_message_dropped() -> None:
    run = Run(lane=None, task=TASK, message=object(), generation=1)
    assert run.state is State.RECEIVED and not run.acked
    run.message = None
    assert run.acked
