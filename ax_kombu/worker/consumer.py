"""The worker's broker side: connect, receive, and reconnect after the broker is lost.

One thread (the one calling :meth:`Consumer.run`, the worker's consuming
thread) owns the broker connection: a Kombu consumer per lane (``high``,
``default``, ``slow``), each on its own channel and feeding its own bounded
pool (:class:`~ax_kombu.worker.lanes.Lane`). Only this thread touches Kombu's
channels (they are not thread-safe). On Redis ≥ 6.2 (unless ``redis_pull`` is
off) a puller thread (:mod:`ax_kombu.broker.redis_pull`) receives instead, many
messages per round trip and never more than each lane's room; it only uses
the channel's connection pool.

Each loop settles what came back (:meth:`~ax_kombu.worker.intake.Intake.settle`),
drains the broker until nothing more is ready or a batch is full, and hands
what arrived to the intake. A message that is too large, not JSON, or not a
well-formed task message is refused before it reaches the intake
(:mod:`ax_kombu.broker.rejects`): logged once with its reason, counted
(``malformed``, and ``ax_rejected_messages_total{reason}``), removed from the
broker without requeue, and its room in the lane freed at once. When a stop
is requested the consumers are cancelled and the :mod:`~ax_kombu.worker.shutdown` steps run
while the connection is still up, so their acks land. A quiet worker
(:mod:`~ax_kombu.worker.quiet`) stays connected and receives nothing new: each loop hands
back whatever still arrives, and settles and acks the runs that end.

Broker loss: the connection is dropped, its unacked messages are the
broker's again (:meth:`~ax_kombu.worker.intake.Intake.connection_lost`), and
the worker reconnects with a doubling pause (0.5 s up to 10 s). The cause is
logged once per change of cause, and once more when the connection is back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from threading import Event
from typing import Any

from kombu import messaging
from kombu.exceptions import OperationalError
from kombu.serialization import prepare_accept_content

from ax_kombu.broker import redis_pull
from ax_kombu.broker.connection import connection, ensure_connected
from ax_kombu.broker.rejects import Rejected
from ax_kombu.config import Settings
from ax_kombu.worker.admission import Admission
from ax_kombu.worker.control import TICK_S, StopFlags, Wakeup
from ax_kombu.worker.counters import Counters
from ax_kombu.worker.intake import Intake
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.quiet import Quiet
from ax_kombu.worker.shutdown import ConnectedStop, Shutdown

log = logging.getLogger(__name__)

#: kombu is untyped: its consumer and connection are handled as Any
_KombuConsumer: Any = messaging.Consumer

#: while a lane is saturated, how long to wait for a run to end before polling the others
SATURATED_TICK_S = 0.002
#: how long a poll waits for one more message before the batch is cut
POLL_S = 0.0005
#: what Kombu raises from drain_events for a value on a Redis list that is not its envelope
_UNREADABLE = (ValueError, KeyError, TypeError, AttributeError, RecursionError)


class _BrokerLost(Exception):
    """The broker connection failed; the worker reconnects."""


class Outage:
    """The reconnect loop's backoff, and its log: one line per change of cause.

    Args:
        first_pause_s: the wait after the first failure; it doubles after each.
        max_pause_s: the longest wait.
        clock: monotonic seconds (for the outage's duration in the log).
    """

    def __init__(self, first_pause_s: float = 0.5, max_pause_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pause = first_pause_s
        self._max_pause = max_pause_s
        self._clock = clock
        #: the last failure's text; None while connected
        self._cause: str | None = None
        self._since = 0.0
        self._attempts = 0

    def failed(self, cause: BaseException | None) -> float:
        """Record a failed or lost connection; returns the seconds to wait before retrying.

        Logs a warning on the first failure and whenever the error text changes;
        a retry failing the same way is logged at debug level only.
        """
        text, pause = repr(cause), self._pause
        if self._cause is None:
            self._since, self._attempts = self._clock(), 0
            log.warning("broker connection lost; reconnecting",
                        extra={"error": text, "retry_in_s": pause})
        elif text != self._cause:
            log.warning("broker still unreachable, with another error; reconnecting",
                        extra={"error": text, "retry_in_s": pause, "attempts": self._attempts})
        else:
            log.debug("broker still unreachable; reconnecting",
                      extra={"error": text, "retry_in_s": pause})
        self._cause = text
        self._attempts += 1
        self._pause = min(pause * 2, self._max_pause)
        return pause

    def recovered(self) -> None:
        """The connection is up: log it if it was down (the pause keeps its length)."""
        if self._cause is None:
            return
        log.info("broker connection restored", extra={
            "down_s": round(self._clock() - self._since, 3), "attempts": self._attempts})
        self._cause = None


class Consumer:
    """Owns the broker connection on the consuming thread; see the module docstring.

    Args:
        lanes: the lanes consumed (the intake's, in the same order).
        intake: gets what arrives, and is driven once per loop.
        shutdown: its connected step (:class:`~ax_kombu.worker.shutdown.ConnectedStop`)
            runs, still connected, when a stop is requested.
        ready: set while consuming, cleared when the connection is dropped.
        quiet: followed once per loop (default: never quiet).
    """

    def __init__(self, settings: Settings, lanes: list[Lane], *, intake: Intake,
                 shutdown: Shutdown, stats: Counters, wakeup: Wakeup, flags: StopFlags,
                 ready: Event, quiet: Quiet | None = None) -> None:
        self._settings = settings
        self._lanes = lanes
        self._intake = intake
        self._receipts = intake.receipts
        self._pending = intake.pending  # the same list for the worker's life
        self._admission = Admission(settings, self._pending, stats)
        #: the stop's step run while this connection is still up
        self.tail = ConnectedStop(shutdown, self.stop_consuming)
        self._stats = stats
        self._wakeup = wakeup
        self._flags = flags
        self.ready = ready
        self._puller: redis_pull.Puller | None = None
        self._outage = Outage()
        self.quiet = quiet or Quiet(intake, shutdown, intake.receipts.node_id)

    def run(self) -> None:
        """Consume until a stop is requested, reconnecting whenever the broker is lost."""
        while not self._flags.stopping:
            try:
                self._session()
            except _BrokerLost as exc:
                self._intake.connection_lost()
                self._sleep(self._outage.failed(exc.__cause__))

    def _session(self) -> None:
        """One connection: attach, loop until stopping, stop while still connected.

        Raises:
            _BrokerLost: the connection failed (the cause is chained).
        """
        conn: Any = connection(self._settings)
        if conn.transport.driver_type == "redis":
            conn.transport_options["ack_emulation"] = False  # see ax_kombu.worker.node (kill -9)
        errors = (OSError, OperationalError, *conn.connection_errors, *conn.channel_errors)
        try:
            ensure_connected(conn)
            self._attach(conn)
            self.quiet.attached(self._lanes)
            self._outage.recovered()
            self.ready.set()
            self._loop(conn)
            self.tail.stop()
        except errors as exc:
            raise _BrokerLost() from exc
        finally:
            self._detach(conn)

    def _loop(self, conn: Any) -> None:
        intake, wakeup, flags, quiet = self._intake, self._wakeup, self._flags, self.quiet
        while not flags.stopping:
            wakeup.clear()
            quiet.follow(self._lanes)
            intake.settle()
            intake.acks.give_room()
            if quiet.active:
                self._receive_quietly()
            else:
                self._receive(conn)
            intake.planner.dispatch()

    def _attach(self, conn: Any) -> None:
        """Start receiving on ``conn``: the puller (batches, Redis) or a Kombu consumer per lane."""
        global_qos = conn.transport.driver_type == "amqp"
        if self._settings.redis_pull and redis_pull.supported(conn):
            puller = redis_pull.Puller(conn.channel(), [lane.queue.name for lane in self._lanes],
                                       prepare_accept_content(["json"]), self._wakeup.poke,
                                       body_limit=self._admission.body_limit)
            self._puller = puller
            self._intake.connected(global_qos, puller)
            for index, lane in enumerate(self._lanes):
                lane.attach(None, global_qos, partial(puller.set_limit, index))
            puller.start()
            return
        generation = self._intake.connected(global_qos, None)
        # a quorum queue refuses a per-channel prefetch (NOT_IMPLEMENTED on basic.consume)
        reconsume = global_qos and self._settings.rabbitmq_queue_type == "quorum"
        for lane in self._lanes:
            # on_message: Kombu hands over the message undecoded, so its size and content
            # type are judged before anything is decoded (_on_raw)
            consumer = _KombuConsumer(conn.channel(), queues=[lane.queue], accept=["json"],
                                      on_message=partial(self._admission.on_raw, lane, generation),
                                      on_decode_error=self._admission.on_decode_error)
            lane.attach(consumer, global_qos, reconsume=reconsume)

    def _detach(self, conn: Any) -> None:
        """Drop the connection: stop the puller, forget the consumers, release it."""
        self.ready.clear()
        if self._puller is not None:
            self._puller.stop()
            self._puller = None
        self._intake.acks.disconnected()
        for lane in self._lanes:
            lane.consumer, lane.pulled = None, None
        try:
            conn.release()
        except Exception:  # closing a broken connection
            log.debug("error closing the broker connection", exc_info=True)

    def stop_consuming(self) -> None:
        """Cancel the Kombu consumers, or stop the puller and take what it had popped."""
        for lane in self._lanes:
            if lane.consumer is not None and lane.consuming:
                lane.consumer.cancel()
            lane.consuming = False
        if self._puller is not None:
            self._puller.stop()
            self._drain_pulled(self._puller)

    def _sleep(self, seconds: float) -> None:
        stop = time.monotonic() + seconds
        while not self._flags.stopping and time.monotonic() < stop:
            time.sleep(TICK_S)

    # -- receiving -----------------------------------------------------------------------------

    def _receive(self, conn: Any) -> None:
        """Drain the broker until nothing more is ready, a batch is full, or we are needed.

        On Redis a puller thread receives instead (:meth:`_take_pulled`).

        Idle, it blocks up to TICK_S for a first message. While a receipt is in
        flight or a lane is saturated it only polls, and returns as soon as there
        is something to settle (a written batch, an ended run whose ack frees room).
        """
        if self._puller is not None:
            self._take_pulled(self._puller)
            return
        saturated = any(lane.saturated() for lane in self._lanes)
        if all(lane.saturated() for lane in self._lanes):
            self._wakeup.wait(TICK_S)
            return
        if saturated and not self._receipts.in_flight and self._wakeup.wait(SATURATED_TICK_S):
            return
        urgent = saturated or self._receipts.in_flight > 0
        limit = min(self._settings.worker_batch_size, sum(lane.room() for lane in self._lanes))
        timeout = POLL_S if urgent else TICK_S
        while len(self._pending) < limit and not (urgent and self._wakeup.is_set()):
            try:
                conn.drain_events(timeout=timeout)
            except TimeoutError:
                return
            except _UNREADABLE as exc:
                # Kombu's Redis transport parses each popped value itself and raises on
                # one that is not its envelope; the value is gone from Redis already
                log.debug("unreadable value from the broker", exc_info=True)
                self._admission.refuse(None, None, Rejected("not_kombu", f"not a Kombu message: "
                                                               f"{type(exc).__name__}"))
            timeout = POLL_S

    def _receive_quietly(self) -> None:
        """Quiet: wait a tick, take what the puller still popped, and hand it back."""
        if self._puller is not None:
            self._take_pulled(self._puller)
        else:
            self._wakeup.wait(TICK_S)
        self.quiet.hand_back()

    def _take_pulled(self, puller: redis_pull.Puller) -> None:
        """Take what the puller popped (see :mod:`ax_kombu.broker.redis_pull`); wait if nothing."""
        if puller.error is not None:
            raise puller.error
        if not puller.inbox:
            self._wakeup.wait(POLL_S if self._receipts.in_flight else TICK_S)
        self._drain_pulled(puller)

    def _drain_pulled(self, puller: redis_pull.Puller) -> None:
        generation = self._intake.acks.generation
        while puller.inbox:
            pulled = puller.inbox.popleft()
            lane = self._lanes[pulled.lane]
            if pulled.error is not None:
                puller.release(pulled.lane)
                self._admission.refuse(lane.queue.name, pulled.message, pulled.error)
            elif not self._admission.on_message(lane, generation, pulled.body, pulled.message):
                puller.release(pulled.lane)
