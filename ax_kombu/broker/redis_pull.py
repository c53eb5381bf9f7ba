"""Batched receipt from Redis: many messages per round trip, in Kombu's message format.

Kombu's Redis consumer takes one ``BRPOP`` per message, a round trip
each, which caps a worker far below what the scheduler publishes
(docs/benchmarks.md, "Figures moved out of the code"). On Redis ≥ 6.2 the
worker therefore *pulls*: a :class:`Puller` thread

* pops, in one round trip, up to each lane's room from each lane's list
  (``RPOP key count`` in a pipeline), from the right, where Kombu's own
  consumer pops;
* when every list with room is empty, blocks in one ``BRPOP`` over them, as
  Kombu does, plus the puller's own *wake list*: a lane that gains room
  meanwhile pushes a token there, which ends the wait at once, even if the
  ``BRPOP`` had not reached Redis yet (Redis checks blocking timeouts only
  about every 100 ms, so a short timeout would not do);
* decodes each value (Kombu's message envelope, JSON body only, within the
  limits of :mod:`ax_kombu.broker.rejects`) and hands it to the worker's
  consuming thread as a :class:`PulledMessage`.

A popped value is already gone from Redis, so acking it has nothing to tell
the broker (Kombu's own consumer with ack emulation off does the same, in
its in-memory QoS). :meth:`PulledMessage.reject` with ``requeue`` pushes the
value back where it is popped next. A body encoding (base64, as a plain
Kombu producer sends) is undone by Kombu; anything but an uncompressed JSON
body is refused without being decoded (:mod:`ax_kombu.broker.rejects`).

Flow control is the worker's own: a lane's room is its prefetch (free slots
× multiplier, :mod:`ax_kombu.worker.lanes`) minus the messages popped for it and not
acked yet, counted here under one lock, so nothing waits in an unbounded
queue and the worker is never handed more than it can start.

Scope: ax's queues carry ax's task messages only, published at priority 0
(:meth:`ax_kombu.broker.messages.Publisher.publish`), so only each queue's base list is
read. A message a plain Kombu producer sends there with another priority sits
in Kombu's per-priority list and is not seen here.

Guarantees are those of Kombu's consumer with ack emulation off (see
:mod:`ax_kombu.worker.node`): a popped message is gone from Redis; if the worker
dies before its task is RUNNING, the task is still DISPATCHING, and the
scheduler's ack timeout dispatches it again.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import orjson

from ax_kombu.broker import rejects
from ax_kombu.broker.rejects import Rejected

log = logging.getLogger(__name__)

#: RPOP with a count needs this Redis version
MIN_VERSION = (6, 2)
#: longest one BRPOP blocks (a stop waits at most this long)
BLOCK_S = 1.0
#: a wake list left behind by a killed worker expires after this long
WAKE_TTL_MS = 60_000


def load_envelope(raw: bytes) -> Any:
    """Kombu's envelope of a popped value (JSON) → dict.

    orjson, a third of the standard decoder's time here; what it refuses and
    the standard decoder accepts (NaN, say) falls back to that. Only for the
    envelope: the body, with the task's payload, is the user's data and keeps
    the standard decoder (orjson turns an integer over 64 bits into a float).
    """
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def supported(conn: Any) -> bool:
    """True if ``conn`` (a connected Kombu connection) is Redis ≥ 6.2."""
    if conn.transport.driver_type != "redis":
        return False
    version = conn.default_channel.client.info("server").get("redis_version", "0")
    return tuple(int(p) for p in str(version).split(".")[:2]) >= MIN_VERSION


class Pulled(NamedTuple):
    """One popped value: the lane's index, its message, and its decoded body.

    ``message`` is None when the value was not a Kombu envelope at all (or too
    large to parse); ``error`` (a :class:`~ax_kombu.broker.rejects.Rejected`, with its
    reason) is set when the value is refused: not an envelope, too large, not
    JSON, another content type, nested too deep.
    """

    lane: int
    message: Any
    body: Any
    error: Exception | None


class PulledMessage:
    """What the worker needs of a Kombu message, for a value popped from Redis."""

    __slots__ = ("_requeue", "acknowledged", "content_type", "lane", "raw")

    def __init__(self, lane: int, raw: bytes, content_type: str | None,
                 requeue: Callable[[int, bytes], None]) -> None:
        self.lane = lane
        self.raw = raw
        self.content_type = content_type
        self.acknowledged = False
        self._requeue = requeue

    def ack(self) -> None:
        """Nothing to tell Redis: the value was removed when it was popped."""
        self.acknowledged = True

    def reject(self, requeue: bool = False) -> None:
        """Drop the message, or put it back at the end of its list that is popped next."""
        if self.acknowledged:
            return
        self.acknowledged = True
        if requeue:
            self._requeue(self.lane, self.raw)


class Puller(threading.Thread):
    """Pops messages for a worker's queues in batches, within each queue's room.

    Args:
        channel: a Kombu Redis channel of the worker's connection. Only its pure
            helpers and its connection pool are used here; the consuming thread
            keeps the channel itself.
        queues: the queue names, in lane order.
        accept: content types allowed (Kombu's ``accept``); a body is decoded only if it
            is JSON, whatever else this allows.
        body_limit: longest body decoded (:func:`ax_kombu.broker.rejects.body_limit`).
        wake: called after new messages are put in :attr:`inbox`.
    """

    def __init__(self, channel: Any, queues: Sequence[str], accept: set[str],
                 wake: Callable[[], None], body_limit: int = rejects.MIN_BODY_LIMIT) -> None:
        super().__init__(name="ax-puller", daemon=True)
        self.channel = channel
        self.accept = accept
        #: longest body decoded, and longest value whose envelope is parsed (rejects.py)
        self.body_limit = body_limit
        self.envelope_limit = rejects.envelope_limit(body_limit)
        self._wake = wake
        self._keys = [str(channel._q_for_pri(q, 0)) for q in queues]
        self._wake_key = f"ax.wake.{uuid.uuid4().hex}"
        self._client = channel.Client(connection_pool=channel.pool,
                                      single_connection_client=True)
        self._control = channel.Client(connection_pool=channel.pool)
        self._cond = threading.Condition()
        self._limit = [0] * len(queues)
        self._out = [0] * len(queues)
        self._stale = False
        self._blocking = False
        self._woken = False
        self._stopped = False
        #: popped messages for the consuming thread
        self.inbox: deque[Pulled] = deque()
        #: the error that ended the thread (the broker is gone), if any
        self.error: BaseException | None = None

    # -- the consuming thread's side ----------------------------------------------------------

    def set_limit(self, lane: int, limit: int) -> None:
        """The most messages of ``lane`` that may be out (popped, not acked) at once."""
        with self._cond:
            grew = limit > self._limit[lane]
            self._limit[lane] = limit
        if grew:
            self._room_opened()

    def release(self, lane: int, n: int = 1) -> None:
        """``n`` messages of ``lane`` were acked (or dropped): their room is free again."""
        with self._cond:
            self._out[lane] -= n
        self._room_opened()

    def stop(self) -> None:
        """Stop popping (returns once the thread has ended; :attr:`inbox` keeps what it has)."""
        with self._cond:
            self._stopped = True
        self._room_opened()
        self.join(BLOCK_S * 4)
        try:
            self._control.delete(self._wake_key)
        except Exception:  # the key expires by itself
            log.debug("could not delete the wake list", exc_info=True)
        for client in (self._client, self._control):
            try:
                client.close()
            except Exception:  # closing a broken connection
                log.debug("error closing a Redis client", exc_info=True)

    def requeue(self, lane: int, raw: bytes) -> None:
        """Push a popped value back to the end of ``lane``'s list that is popped next.

        Works after :meth:`stop` too (a client of the channel's pool, made for the call).
        """
        client = self.channel.Client(connection_pool=self.channel.pool)
        try:
            client.rpush(self._keys[lane], raw)
        finally:
            client.close()

    def _room_opened(self) -> None:
        with self._cond:
            self._stale = True
            self._cond.notify()
            wake = self._blocking and not self._woken
            self._woken = self._woken or wake
        if wake:
            try:
                pipe = self._control.pipeline(transaction=False)
                pipe.lpush(self._wake_key, b"1")
                pipe.pexpire(self._wake_key, WAKE_TTL_MS)
                pipe.execute()
            except Exception:  # the BRPOP then ends by its timeout
                log.debug("could not wake the puller", exc_info=True)

    # -- the puller thread ----------------------------------------------------------------------

    def run(self) -> None:
        try:
            while self._pull_once():
                pass
        except Exception as exc:  # noqa: BLE001 - the broker is gone: the worker reconnects
            self.error = exc
        finally:
            self._wake()

    def _pull_once(self) -> bool:
        with self._cond:
            if self._stopped:
                return False
            rooms = [limit - out for limit, out in zip(self._limit, self._out, strict=True)]
            if not any(r > 0 for r in rooms):
                self._stale = False
                self._cond.wait(BLOCK_S)
                return True
            self._stale = False
        if self._pop(rooms):
            return True
        with self._cond:
            if self._stale or self._stopped:
                return True
            self._blocking = True
        try:
            self._block([i for i, r in enumerate(rooms) if r > 0])
        finally:
            with self._cond:
                self._blocking = self._woken = False
        return True

    def _pop(self, rooms: list[int]) -> bool:
        pipe = self._client.pipeline(transaction=False)
        wanted = [i for i, room in enumerate(rooms) if room > 0]
        for i in wanted:
            pipe.rpop(self._keys[i], rooms[i])
        got = [(i, values or []) for i, values in zip(wanted, pipe.execute(), strict=True)]
        self._deliver([(i, v) for i, values in got for v in values])
        return any(values for _, values in got)

    def _block(self, lanes: list[int]) -> None:
        """One BRPOP over the lanes' lists and the wake list (a token there only wakes us)."""
        by_key = {self._keys[i]: i for i in lanes}
        got = self._client.brpop([*by_key, self._wake_key], timeout=BLOCK_S)
        if got:
            key, value = got
            lane = by_key.get(key.decode() if isinstance(key, bytes) else key)
            if lane is not None:
                self._deliver([(lane, value)])

    def _deliver(self, values: list[tuple[int, bytes]]) -> None:
        if not values:
            return
        with self._cond:
            for lane, _ in values:
                self._out[lane] += 1
        self.inbox.extend(self._decode(lane, raw) for lane, raw in values)
        self._wake()

    def _decode(self, lane: int, raw: bytes) -> Pulled:
        """One popped value → a :class:`Pulled`; what is not a task message body carries a
        :class:`~ax_kombu.broker.rejects.Rejected` as its error (see that module)."""
        if len(raw) > self.envelope_limit:  # not even the envelope is parsed
            return Pulled(lane, None, None, Rejected(
                "too_large", f"value of {len(raw)} bytes, over the limit of "
                             f"{self.envelope_limit}"))
        try:
            envelope = load_envelope(raw)
            content_type = envelope.get("content-type")
            message = PulledMessage(lane, raw, content_type, self.requeue)
        except (ValueError, TypeError, AttributeError, RecursionError) as exc:
            return Pulled(lane, None, None, Rejected(
                "not_kombu", f"not a Kombu message: {str(exc)[:200]}"))  # also UnicodeDecodeError
        try:
            body = envelope.get("body")
            if (envelope.get("properties") or {}).get("body_encoding"):
                # a plain Kombu producer's message (base64): Kombu decodes the body encoding
                body = self.channel.Message(envelope, channel=self.channel).body
            # JSON only, as ax publishes it, with the standard decoder. (Kombu's JSON loads
            # calls a Python object hook on every dict, for its own type markers, which ax
            # messages never carry; that was a sixth of the worker's GIL time.)
            return Pulled(lane, message, rejects.decode_body(
                body, content_type, envelope.get("content-encoding"), envelope.get("headers"),
                self.body_limit), None)
        except Rejected as exc:
            return Pulled(lane, message, None, exc)
        except Exception as exc:  # noqa: BLE001 - an envelope Kombu cannot read
            return Pulled(lane, message, None, Rejected(
                "not_kombu", f"unreadable Kombu envelope: {type(exc).__name__}"))
