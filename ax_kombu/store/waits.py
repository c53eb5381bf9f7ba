"""Ends announced to waiters: PostgreSQL ``NOTIFY ax_ended``, and the listeners that wake
``ax.wait`` and its async twin.

**Emit.** Every store function that moves tasks to a final status (SUCCESS, FAILED,
CANCELLED) sends, in the transaction of that move, ``NOTIFY ax_ended`` with the ids that
ended as its payload: decimal ids joined by commas, at most :data:`IDS_PER_NOTIFY` per
notification (PostgreSQL refuses a payload of 8,000 bytes or more), so a large batch
sends several notifications — from ONE statement, never one per row
(:func:`notify_ended`, or :data:`NOTIFY_MOVED` folded into the move's own statement).
A notification is delivered at commit, so a waiter woken by it reads the ended row. An
empty payload means "re-check every task you wait for"; the store never sends one, but
listeners honour it (an operator may ``NOTIFY ax_ended``). SQLite has no such channel:
there waits poll.

Cost: PostgreSQL serializes the commits of notifying transactions (one cluster-wide lock,
kept until the commit ends), listener or not. Ends written in batches (the worker's result
writer) pay one notifying commit per batch, nothing measurable; many concurrent
transactions of one end each (Celery's per-run ends) lose some of their parallel commits.

**Listen.** :class:`EndListener` (threads, psycopg2) and :class:`AsyncEndListener`
(asyncio, psycopg 3) each keep one dedicated connection LISTENing. A waiter registers
its id *before* it reads the row, so an end committed between the read and the wait
still wakes it. A notification for its id, an empty payload, or a (re)connection of
the listener (ends may have been missed while it was away) wakes it to read its row
again. Waiters keep a slow safety poll (:data:`SAFETY_POLL_S`): a lost notification
costs latency, never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import select
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, text

log = logging.getLogger(__name__)

#: the channel of ends
ENDED_CHANNEL = "ax_ended"
#: ids per notification: 20 bytes each at most (19 digits and a comma) stays well under
#: PostgreSQL's 8,000-byte payload limit
IDS_PER_NOTIFY = 350
#: the longest a waiter sleeps between two reads of its row, notified or not
SAFETY_POLL_S = 1.0
#: the pause before a listener that lost its connection connects again
RECONNECT_PAUSE_S = 0.5

_FINAL_SQL = "('SUCCESS', 'FAILED', 'CANCELLED')"

#: appended to a statement ``WITH moved AS (UPDATE … RETURNING task_id, status)``: returns
#: the moved ids and, in the same statement, notifies those that reached a final status
#: (the count makes the notifying part run: a CTE that nothing reads is never evaluated)
NOTIFY_MOVED = f"""
, sent AS (
  SELECT pg_notify('{ENDED_CHANNEL}', string_agg(CAST(task_id AS TEXT), ',')) AS n
    FROM (SELECT task_id, (row_number() OVER ()) / {IDS_PER_NOTIFY} AS part
            FROM moved WHERE status IN {_FINAL_SQL}) AS ended
   GROUP BY part)
SELECT task_id FROM moved WHERE (SELECT count(*) FROM sent) >= 0"""

_NOTIFY = text(f"SELECT pg_notify('{ENDED_CHANNEL}', p) FROM unnest(CAST(:payloads AS TEXT[])) AS p")


def payloads(task_ids: Sequence[int]) -> list[str]:
    """The payloads announcing ``task_ids``: comma-joined, :data:`IDS_PER_NOTIFY` each."""
    return [",".join(map(str, task_ids[i:i + IDS_PER_NOTIFY]))
            for i in range(0, len(task_ids), IDS_PER_NOTIFY)]


def notify_ended(conn: Connection, task_ids: Iterable[int]) -> None:
    """Announce (at the commit of ``conn``'s transaction) that ``task_ids`` reached a
    final status: one statement, whatever their number. No-op on SQLite and for no id."""
    ids = list(task_ids)
    if ids and conn.dialect.name == "postgresql":
        conn.execute(_NOTIFY, {"payloads": payloads(ids)})


def parse(payload: str) -> list[int] | None:
    """The ids of a notification's payload; None for "re-check all" (empty, or not ids)."""
    try:
        return [int(p) for p in payload.split(",")] if payload else None
    except ValueError:
        return None


class Waiters:
    """Who waits for which id: each waiter's wake-up flag (a ``threading.Event`` or an
    ``asyncio.Event``, anything with ``set()``), by task id. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[int, set[Any]] = {}

    def add(self, task_id: int, flag: Any) -> None:
        with self._lock:
            self._by_id.setdefault(task_id, set()).add(flag)

    def remove(self, task_id: int, flag: Any) -> None:
        with self._lock:
            flags = self._by_id.get(task_id)
            if flags is not None:
                flags.discard(flag)
                if not flags:
                    del self._by_id[task_id]

    def wake(self, task_ids: list[int] | None) -> list[Any]:
        """The flags of the waiters on ``task_ids`` (None: every waiter), for the caller to
        set."""
        with self._lock:
            if task_ids is None:
                return [f for flags in self._by_id.values() for f in flags]
            return [f for i in task_ids for f in self._by_id.get(i, ())]


class Flag(Protocol):
    """What a sync waiter waits on (:meth:`EndListener.watch`, :class:`Polling`)."""

    def clear(self) -> None: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class Polling:
    """The :class:`Flag` of a store without notifications (SQLite): never set; each wait
    sleeps, from 10 ms doubling to 0.5 s (at most its ``timeout``)."""

    def __init__(self) -> None:
        self._pause = 0.01

    def clear(self) -> None:
        return None

    def wait(self, timeout: float | None = None) -> bool:
        time.sleep(max(0.0, min(self._pause, self._pause if timeout is None else timeout)))
        self._pause = min(self._pause * 2, 0.5)
        return False


class EndListener:
    """One thread and one dedicated psycopg2 connection LISTENing on ``ax_ended`` for the
    waits of one client (started by its first :meth:`watch`). Reconnects after an error;
    :meth:`close` stops it.

    Use::

        with listener.watch(task_id) as woken:   # registered before the read
            while <the row read now is not final>:
                woken.wait(min(left, SAFETY_POLL_S)); woken.clear()
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._waiters = Waiters()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        #: the listening connection's server process id (None while not connected)
        self.backend_pid: int | None = None

    @contextmanager
    def watch(self, task_id: int) -> Iterator[threading.Event]:
        """Register a waiter on ``task_id`` for the block; yields its flag, set when the
        task may have ended (clear it before reading the row again)."""
        self._start()
        flag = threading.Event()
        self._waiters.add(task_id, flag)
        try:
            yield flag
        finally:
            self._waiters.remove(task_id, flag)

    def close(self) -> None:
        """Stop the thread; it closes its connection within half a second."""
        self._stop.set()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="ax-end-listener",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen()
            except Exception:
                log.warning("end listener lost its connection; retrying", exc_info=True)
                self._stop.wait(RECONNECT_PAUSE_S)

    def _connect(self) -> Any:
        """A psycopg2 connection outside the engine's pool, in autocommit."""
        dialect = self._engine.dialect
        cargs, cparams = dialect.create_connect_args(self._engine.url)
        pg = dialect.connect(*cargs, **cparams)
        pg.autocommit = True
        return pg

    def _listen(self) -> None:
        pg = self._connect()
        try:
            with pg.cursor() as cursor:
                cursor.execute(f"LISTEN {ENDED_CHANNEL}")
            self.backend_pid = pg.get_backend_pid()
            _set(self._waiters.wake(None))  # ends while it was not listening
            while not self._stop.is_set():
                if select.select([pg], [], [], 0.5)[0]:
                    pg.poll()
                    while pg.notifies:
                        _set(self._waiters.wake(parse(pg.notifies.pop(0).payload)))
        finally:
            self.backend_pid = None
            pg.close()


def _set(flags: list[Any]) -> None:
    for flag in flags:
        flag.set()


class AsyncWatch:
    """One registered async waiter (see :meth:`AsyncEndListener.watch`)."""

    def __init__(self) -> None:
        self.flag = asyncio.Event()

    async def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a wake-up; True when woken (the flag is then
        cleared: read the row again, and wait again if it has not ended), False on timeout.
        """
        if not self.flag.is_set():
            try:
                await asyncio.wait_for(self.flag.wait(), max(timeout, 0.0))
            except TimeoutError:
                return False
        self.flag.clear()
        return True


class AsyncEndListener:
    """One psycopg 3 ``AsyncConnection`` (autocommit) LISTENing on ``ax_ended``, for the
    async client (:mod:`ax_kombu.aio`); made from a libpq URL or DSN, connected by the
    first :meth:`watch`, in the running loop; reconnects after an error.

    The race-free pattern (register, then read, then wait; loop with a slow poll)::

        async with listener.watch(task_id) as w:
            while True:
                row = await read_row(task_id)       # after registering
                if row is final: return row
                if out of time: raise WaitTimeout
                await w.wait(min(left, SAFETY_POLL_S))

    ``w.wait`` returns True on a notification for that id, an empty ("re-check")
    payload, or a reconnection; False on timeout. :meth:`aclose` closes it.
    """

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._waiters = Waiters()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        #: the listening connection's server process id (None while not connected)
        self.backend_pid: int | None = None

    @asynccontextmanager
    async def watch(self, task_id: int) -> AsyncIterator[AsyncWatch]:
        """Register a waiter on ``task_id`` (at once, before the block runs) for the block."""
        self._start()
        watch = AsyncWatch()
        self._waiters.add(task_id, watch.flag)
        try:
            yield watch
        finally:
            self._waiters.remove(task_id, watch.flag)

    async def ended(self, task_id: int, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a wake-up about ``task_id`` (registered now: an end
        committed before this call is missed; prefer :meth:`watch`). True when woken."""
        async with self.watch(task_id) as w:
            return await w.wait(timeout)

    async def aclose(self) -> None:
        """Stop listening and close the connection."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and task.get_loop() is asyncio.get_running_loop():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def _start(self) -> None:
        """Listen from the running loop (again, if an earlier loop's listening ended)."""
        loop = asyncio.get_running_loop()
        task = self._task
        if not self._closed and (task is None or task.done() or task.get_loop() is not loop):
            self._task = loop.create_task(self._run())

    async def _run(self) -> None:
        while not self._closed:
            try:
                await self._listen()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("async end listener lost its connection; retrying", exc_info=True)
                await asyncio.sleep(RECONNECT_PAUSE_S)

    async def _listen(self) -> None:
        import psycopg  # the async extra; never loaded by a sync producer

        async with await psycopg.AsyncConnection.connect(self._dsn, autocommit=True) as pg:
            await pg.execute(f"LISTEN {ENDED_CHANNEL}")
            self.backend_pid = pg.info.backend_pid
            try:
                _set(self._waiters.wake(None))  # ends while it was not listening
                async for note in pg.notifies():
                    _set(self._waiters.wake(parse(note.payload)))
            finally:
                self.backend_pid = None
