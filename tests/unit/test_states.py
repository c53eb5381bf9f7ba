from __future__ import annotations

import pytest

from ax_kombu.core.states import ACTIVE, FINAL, TRANSITIONS, Status, check
from ax_kombu.exceptions import IllegalTransition


def test_every_non_final_state_can_be_cancelled() -> None:
    for status in ACTIVE:
        assert Status.CANCELLED in TRANSITIONS[status]
    assert {s for s in Status if Status.CANCELLED in TRANSITIONS[s]} == ACTIVE
    # what the cancel does (store/moves.py): every active state at once is a legal source
    assert set(check(sorted(ACTIVE), Status.CANCELLED)) == ACTIVE


@pytest.mark.parametrize("source,target", [
    (Status.SUCCESS, Status.RUNNING),
    (Status.CREATED, Status.RUNNING), (Status.READY, Status.SUCCESS),
    (Status.DELAYED, Status.RUNNING), (Status.SUCCESS, Status.CANCELLED),
])
def test_illegal_transitions_are_refused(source: Status, target: Status) -> None:
    with pytest.raises(IllegalTransition, match=f"from {source} to {target}"):
        check([source], target)


def test_one_illegal_source_refuses_the_whole_move() -> None:
    with pytest.raises(IllegalTransition):
        check([Status.READY, Status.SUCCESS], Status.CANCELLED)


def test_final_states_have_no_way_out_but_manual_retry() -> None:
    assert TRANSITIONS[Status.SUCCESS] == frozenset()
    assert TRANSITIONS[Status.CANCELLED] == frozenset({Status.READY})  # ax retry
    assert TRANSITIONS[Status.FAILED] == frozenset({Status.READY})
    assert FINAL == {Status.SUCCESS, Status.FAILED, Status.CANCELLED}


@pytest.mark.parametrize("source", [Status.CREATED, Status.DELAYED, Status.READY])
@pytest.mark.parametrize("target", [Status.DELAYED, Status.READY])
def test_a_pending_task_may_be_moved_to_another_time(source: Status, target: Status) -> None:
    assert check([source], target) == (source,)


@pytest.mark.parametrize("source", [Status.DISPATCHING, Status.SUCCESS, Status.FAILED])
def test_a_claimed_or_finished_task_is_not_moved_to_a_later_time(source: Status) -> None:
    with pytest.raises(IllegalTransition):
        check([source], Status.DELAYED)
