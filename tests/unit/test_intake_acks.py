"""RabbitMQ acks go out in as few frames as is safe: one ``multiple`` ack for everything below
the lane's oldest message still unacked, one each above it, none kept past the loop."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kombu import Queue

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.core.lease import Lease
from ax_kombu.worker.control import StopFlags, Wakeup
from ax_kombu.worker.counters import Counters
from ax_kombu.worker.intake import Intake
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.run import Run

pytestmark = pytest.mark.timeout(30)


class Message:
    """A received AMQP message: its delivery tag, and the acks sent for it."""

    def __init__(self, tag: int, sent: list[tuple[int, bool]]) -> None:
        self.delivery_tag = tag
        self._sent = sent

    def ack(self, multiple: bool = False) -> None:
        self._sent.append((self.delivery_tag, multiple))


class Receipts:
    full = False
    in_flight = 0

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, batch: Any) -> None:
        self.sent.append(batch)

    def take(self) -> None:
        return None


@pytest.fixture
def intake() -> Any:
    wakeup = Wakeup()
    lane = Lane("default", Queue("q"), 8, 1, wakeup.poke, 1.0)
    intake = Intake([lane], receipts=Receipts(), results=None,  # type: ignore[arg-type]
                    resolver=None, stats=Counters(), wakeup=wakeup,  # type: ignore[arg-type]
                    flags=StopFlags(), clock=lambda: time.time() * 1000, lease=Lease(5.0))
    yield intake
    lane.pool.close()


def arrive(intake: Intake, n: int, sent: list[tuple[int, bool]],
           first_tag: int = 1) -> list[Run[Lane]]:
    """``n`` messages received on the lane's channel, as the admission hands them over."""
    lane = intake.lanes[0]
    now = int(time.time() * 1000)
    deliveries = []
    for tag in range(first_tag, first_tag + n):
        task = TaskMessage(tag, 1, "t", {}, "tr", now, 60_000, "default", 0, 3, "p", None, now,
                           "s0")
        lane.unacked += 1
        deliveries.append(Run(lane=lane, task=task, message=Message(tag, sent),
                              generation=intake.acks.generation))
    intake.pending.extend(deliveries)
    return deliveries


def test_acks_below_the_oldest_unacked_message_go_as_one_multiple_ack(intake: Intake) -> None:
    sent: list[tuple[int, bool]] = []
    intake.connected(True, None)  # RabbitMQ
    d = arrive(intake, 6, sent)
    intake.planner.dispatch()
    for i in (0, 1, 3, 2):  # tags 1, 2, 4, 3 end; 5 and 6 still run
        intake.acks.ack(d[i])
    assert sent == []  # nothing goes out before the loop flushes
    intake.acks.flush()
    assert sent == [(4, True)]  # one frame for tags 1-4
    intake.acks.ack(d[5])  # tag 6 ends while tag 5 runs: its own ack, not a multiple one
    intake.acks.flush()
    assert sent[1:] == [(6, False)]
    intake.acks.ack(d[4])
    intake.acks.flush()
    assert sent[2:] == [(5, True)]  # tag 6 is settled already, so 5 may cover everything
    intake.acks.ack(d[4])  # a second ack of the same delivery sends nothing
    intake.acks.flush()
    assert len(sent) == 3


def test_a_message_received_and_not_planned_yet_bounds_the_multiple_ack(intake: Intake) -> None:
    sent: list[tuple[int, bool]] = []
    intake.connected(True, None)
    d = arrive(intake, 3, sent)
    intake.planner.dispatch()
    later = arrive(intake, 2, sent, first_tag=4)  # still in pending
    intake.acks.ack(d[0])
    intake.acks.ack(later[1])  # tag 5, above tag 4 which is still only received
    intake.acks.flush()
    assert sorted(sent) == [(1, True), (5, False)]


def test_acks_of_a_lost_connection_are_void(intake: Intake) -> None:
    sent: list[tuple[int, bool]] = []
    intake.connected(True, None)
    d = arrive(intake, 2, sent)
    intake.planner.dispatch()
    intake.acks.ack(d[0])
    intake.connected(True, None)  # a new connection before the loop flushed: tags restart
    intake.acks.flush()
    assert sent == []


def test_other_transports_ack_each_message_at_once(intake: Intake) -> None:
    sent: list[tuple[int, bool]] = []
    intake.connected(False, None)
    d = arrive(intake, 2, sent)
    intake.planner.dispatch()
    intake.acks.ack(d[1])
    assert sent == [(2, False)]
