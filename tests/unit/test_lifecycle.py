"""The node lifecycle: register → beat → confirm the lease → re-register when refused."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from ax_kombu.core.lease import Lease
from ax_kombu.exceptions import NodeNameInUse
from ax_kombu.node.lifecycle import NodeLifecycle
from ax_kombu.store.nodes import TakeOver


class FakeHeartbeat:
    """A node row in memory: ``answers`` are what the next beats do (True, False or an
    exception to raise)."""

    node_id = "n1"

    def __init__(self, *answers: bool | Exception) -> None:
        self.incarnation = 0
        self.answers = list(answers)
        self.kept: list[Sequence[int]] = []
        self.register_error: Exception | None = None

    def register(self, info: Mapping[str, Any], keep_running: Sequence[int] = ()) -> TakeOver:
        if self.register_error is not None:
            raise self.register_error
        self.incarnation += 1
        self.kept.append(keep_running)
        return TakeOver(0, 0)

    def beat(self, info: Mapping[str, Any]) -> bool:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def _lifecycle(heart: FakeHeartbeat, calls: list[str]) -> tuple[NodeLifecycle, Lease]:
    lease = Lease(10.0)
    life = NodeLifecycle(heart, lease, dict, keep_running=lambda: {3, 1},  # type: ignore[arg-type]
                         on_refused=lambda: calls.append(f"refused:{lease.valid()}"),
                         on_registered=lambda took: calls.append("registered"),
                         on_failed=lambda: calls.append("failed"))
    return life, lease


def test_register_then_beats_confirm_the_lease() -> None:
    calls: list[str] = []
    heart = FakeHeartbeat(True, True)
    life, lease = _lifecycle(heart, calls)
    life.register()
    assert lease.covers(1) and calls == ["registered"] and heart.kept == [[1, 3]]
    assert life.beat() and life.beat() and life.beats == 2


def test_a_refused_beat_revokes_the_lease_then_registers_anew_keeping_the_runs() -> None:
    calls: list[str] = []
    heart = FakeHeartbeat(False)
    life, lease = _lifecycle(heart, calls)
    life.register()
    assert life.beat()
    assert calls == ["registered", "refused:False", "registered"]  # revoked before the hook
    assert heart.incarnation == 2 and lease.covers(2) and lease.covers(1) is False
    assert heart.kept == [[1, 3], [1, 3]]


def test_a_failed_beat_is_counted_not_raised_and_confirms_nothing() -> None:
    calls: list[str] = []
    heart = FakeHeartbeat(OperationalError("beat", {}, Exception("down")), False)
    life, lease = _lifecycle(heart, calls)
    life.register()
    lease.revoke()
    assert not life.beat() and calls == ["registered", "failed"] and not lease.valid()
    heart.register_error = OperationalError("register", {}, Exception("down"))
    assert not life.beat()  # refused, and the new registration failed: next beat retries
    assert calls[-1] == "failed" and not lease.valid()


def test_a_name_taken_meanwhile_ends_the_beats() -> None:
    heart = FakeHeartbeat(False)
    life, _ = _lifecycle(heart, [])
    life.register()
    heart.register_error = NodeNameInUse("taken")
    with pytest.raises(NodeNameInUse):
        life.beat()


class FakeLiveness:
    """What the scheduler's heart tells its Liveness, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def fenced(self) -> None:
        self.calls.append("fenced")

    def registered(self, now: int) -> None:
        self.calls.append(f"registered@{now}")

    def landed(self, now: int) -> None:
        self.calls.append(f"landed@{now}")

    def database_failed(self) -> None:
        self.calls.append("failed")


def test_the_scheduler_heart_beats_through_the_lifecycle() -> None:
    from ax_kombu.scheduler.heart import Heart

    heart = FakeHeartbeat(True, False, OperationalError("beat", {}, Exception("down")))
    liveness, lease = FakeLiveness(), Lease(10.0)
    beating = Heart(liveness, heart, 1.0, lambda: 7.0, lease, dict)  # type: ignore[arg-type]
    beating.lifecycle.register()
    beating.beat()  # lands
    beating.beat()  # refused: the wheel is dropped, then the node registers anew
    beating.beat()  # fails: the node stops judging others
    assert liveness.calls == ["registered@7", "landed@7", "fenced", "registered@7", "landed@7",
                              "failed"]
    assert heart.incarnation == 2 and lease.covers(2) and beating.beats == 2
