"""Acks: each message acked once, on its own connection, in as few frames as is safe.

Acks are only valid on the connection a message came on: each connection is a
*generation* (:meth:`Acks.connected`), and an ack for an earlier one is skipped. A run
acks its message at most once (:meth:`Acks.ack` drops the run's ``message``); on RabbitMQ
the acks of one loop go out together (:meth:`Acks.flush`, ``multiple`` where it is safe),
and with a puller (Redis) the room they free is reported once per loop
(:meth:`Acks.give_room`). Everything here runs on the consuming thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from ax_kombu.broker import redis_pull
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.run import Run


class Acks:
    """The acks of the worker's lanes (see the module docstring).

    Args:
        lanes: the lanes, in the order the puller numbers them.
        pending: the intake's received runs not planned yet (they bound a multiple ack).
    """

    def __init__(self, lanes: Sequence[Lane], pending: list[Run[Lane]]) -> None:
        self._lanes = lanes
        self._pending = pending
        #: the current broker connection (acks for an earlier one are void)
        self.generation = 0
        self.global_qos = False
        self._puller: redis_pull.Puller | None = None
        #: acks per lane not yet reported to the puller
        self._released = [0] * len(lanes)
        #: RabbitMQ: this loop's acked messages per lane, sent together by flush()
        self._acks: dict[Lane, list[Any]] = {}
        #: RabbitMQ: each lane's planned runs in arrival (delivery tag) order; the acked
        #: ones are dropped from the left as flush() finds them
        self._arrived: dict[Lane, deque[Run[Lane]]] = {lane: deque() for lane in lanes}

    def connected(self, global_qos: bool, puller: redis_pull.Puller | None) -> int:
        """A new broker connection: returns its generation, which its runs carry.

        Args:
            global_qos: set the prefetch per channel (RabbitMQ).
            puller: when a puller receives, it is told of the room acks free.
        """
        self.generation += 1
        self.global_qos = global_qos
        self._puller = puller
        self._released = [0] * len(self._lanes)
        self._forget()
        return self.generation

    def disconnected(self) -> None:
        """The connection is closed: no more room is reported to its puller."""
        self._puller = None

    def lost(self) -> None:
        """The connection was lost: acks for its messages are void from now on."""
        self.generation += 1
        self._forget()

    def arrived(self, runs: Sequence[Run[Lane]]) -> None:
        """RabbitMQ: ``runs`` are planned, in arrival order (they bound a multiple ack)."""
        if self.global_qos:
            for run in runs:
                self._arrived[run.lane].append(run)

    def ack(self, run: Run[Lane]) -> None:
        """Ack a run's message once, if it came on the current connection (on RabbitMQ at
        the next :meth:`flush`, which whoever acks calls before it waits)."""
        message = run.message
        if message is None or run.generation != self.generation:
            return
        run.message = None
        run.lane.unacked -= 1
        if self.global_qos:
            self._acks.setdefault(run.lane, []).append(message)
            return
        message.ack()
        if self._puller is not None:
            self._released[self._lanes.index(run.lane)] += 1

    def flush(self) -> None:
        """RabbitMQ: send the acks :meth:`ack` collected, in as few frames as is safe.

        A lane's messages share one channel, whose delivery tags grow in arrival order.
        Every tag below the lane's oldest message still unacked is settled (acked or
        rejected), so the acks below it go as ONE ``basic.ack`` with ``multiple`` (up to the
        highest of them); an ack above it (a run still going keeps an older message) goes
        on its own. Nothing is kept for a later loop, so a connection that closes after
        this loses no ack."""
        for lane, acks in self._acks.items():
            arrived = self._arrived[lane]
            while arrived and arrived[0].acked:
                arrived.popleft()
            oldest = [r.message.delivery_tag for r in (arrived[0] if arrived else None,
                                                       self._first_pending(lane)) if r]
            below = min(oldest) if oldest else None
            top: Any = None
            for message in acks:
                tag = message.delivery_tag
                if below is not None and tag > below:
                    message.ack()
                elif top is None or tag > top.delivery_tag:
                    top = message
            if top is not None:
                top.ack(multiple=True)
        self._acks.clear()

    def _first_pending(self, lane: Lane) -> Run[Lane] | None:
        """The lane's first run received and not planned yet (not in _arrived yet)."""
        return next((r for r in self._pending if r.lane is lane and not r.acked), None)

    def _forget(self) -> None:
        """A new connection: acks collected for the old one are void, tags start again."""
        self._acks.clear()
        for arrived in self._arrived.values():
            arrived.clear()

    def give_room(self) -> None:
        """Tell the puller, once per loop, how much room the acks since the last call freed."""
        if self._puller is not None:
            for index, n in enumerate(self._released):
                if n:
                    self._puller.release(index, n)
        self._released = [0] * len(self._lanes)
