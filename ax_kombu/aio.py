"""The asyncio producer API: ``await`` enqueue, enqueue_many, get, wait, cancel, reschedule
and run_now, without blocking the event loop::

    import ax_kombu.aio as axio

    task_id = await axio.enqueue("order.close", {"order": 42}, delay=1800)
    view = await axio.wait(task_id)

    async with axio.AsyncClient(settings) as client:   # or a client of your own
        await client.enqueue_many(items, connection=session)

Same options, same validation and the same errors as the sync API (:mod:`ax_kombu.api`,
whose pure parts it reuses); what differs is how the I/O is done:

* **PostgreSQL**: SQLAlchemy's async engine on psycopg 3 (``ax_kombu[async]``), or asyncpg
  with a ``postgresql+asyncpg://`` URL; the store's own SQL runs on the async connection
  (:mod:`ax_kombu.store.async_engine` says how, and how the loop stays responsive).
  ``wait`` is woken by the ``ax_ended`` notification (:mod:`ax_kombu.store.waits`).
* **SQLite** (the embedded default): no async driver is needed; every call runs the sync
  client in a worker thread (``asyncio.to_thread``), and ``wait`` polls.

``connection=`` takes a SQLAlchemy ``AsyncConnection`` or ``AsyncSession`` on the ax
database: the tasks commit or roll back with the caller's transaction, under the rules of
:mod:`ax_kombu.store.borrowed`. Anything else is a :class:`ValidationError`, and nothing
is written.

An :class:`AsyncClient` belongs to the event loop that first uses it. The module-level
functions use one per event loop and per process, made from the settings
:func:`ax_kombu.client` uses (``AX_*`` variables and :func:`ax_kombu.configure`).
"""

from __future__ import annotations

import asyncio
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import datetime
from types import TracebackType
from typing import Any, Self, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from ax_kombu import config
from ax_kombu.api import Client, item_rows, read_task, task_ids
from ax_kombu.config import Settings, from_env
from ax_kombu.core import states
from ax_kombu.exceptions import ValidationError, WaitTimeout
from ax_kombu.moving import UNCHANGED, Moving
from ax_kombu.observability import tracing
from ax_kombu.store.async_engine import AsyncStore, LoopStore, async_connection, libpq_url
from ax_kombu.store.enqueue import Written
from ax_kombu.store.waits import SAFETY_POLL_S, AsyncEndListener
from ax_kombu.views import TaskId, TaskView

T = TypeVar("T")

#: how long the loop may run an ``enqueue_many``'s validation before yielding to others
_SLICE_S = 0.0005
#: items' results made per step of a large batch (each step runs without yielding)
_RESULTS_PER_STEP = 250


class _Mover(Moving):
    """:class:`~ax_kombu.moving.Moving`'s cancel and moves, run on the loop store's sync
    facade (inside ``greenlet_spawn``)."""

    def __init__(self, settings: Settings, store: LoopStore) -> None:
        self.settings = settings
        self.store = store

    def get(self, task_id: int) -> TaskView:
        with self.store.engine.connect() as conn:
            return read_task(conn, task_id)


class AsyncClient:
    """A producer's asyncio handle on one store (PostgreSQL: async I/O; SQLite: the sync
    client in a thread). Use one per event loop; ``async with`` closes it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pid = os.getpid()
        self._sync: Client | None = None
        self._sync_made = asyncio.Lock()
        self._store: AsyncStore | None = None
        self._listener: AsyncEndListener | None = None
        if not settings.is_sqlite:
            self._store = AsyncStore(settings)
            self._mover = _Mover(settings, self._store.loop_store)
        # every enqueue reads the current trace context: the OpenTelemetry API's first
        # import (several ms) happens here, in the constructor, not in a call on the loop
        tracing.available()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        await self.aclose()

    async def enqueue(self, task_type: str, payload: Any = None, *, connection: Any = None,
                      **options: Any) -> TaskId:
        """Create one task; the arguments are :func:`ax_kombu.enqueue`'s.

        Returns:
            The task id; ``.created`` is False when it matched an existing task.
        Raises:
            ValidationError: bad input, or a ``connection`` that is not an async
                SQLAlchemy connection or session on the ax database; nothing was written.
        """
        item = dict(options, task_type=task_type, payload=payload)
        return (await self.enqueue_many([item], connection=connection))[0]

    async def enqueue_many(self, items: Iterable[Mapping[str, Any]], *,
                           connection: Any = None) -> list[TaskId]:
        """Create many tasks in one transaction (with ``connection``, the caller's); each
        item holds :func:`ax_kombu.enqueue`'s arguments.

        Raises:
            ValidationError: any item is invalid, or ``connection`` cannot be used;
                nothing was written.
        """
        given = async_connection(connection)
        if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
            raise ValidationError("enqueue_many takes an iterable of mappings of enqueue "
                                  f"arguments, got {type(items).__name__}")
        if self._store is None:
            return await self._enqueue_threaded(list(items), given)
        async with self._store.turns:
            return await self._enqueue_on_loop(items, given)

    async def _enqueue_on_loop(self, items: Iterable[Mapping[str, Any]],
                               given: AsyncConnection | AsyncSession | None) -> list[TaskId]:
        assert self._store is not None
        now = await self._store.fresh_ms()
        groups = await _rows_of(self.settings, now, items)
        rows = [row for group in groups for row in group]
        if not rows:
            return []
        await self._store.assign_ids(rows)
        args = (rows, self.settings.dedup_window_ms, now + self.settings.preload_window_ms, now)
        written = await self._store.write(given, *args)
        del args
        rows.clear()  # the rows are freed a step at a time, by _results
        return await _results(groups, written)

    async def _enqueue_threaded(self, items: list[Any],
                                given: AsyncConnection | AsyncSession | None) -> list[TaskId]:
        sync = await self._sync_client()
        if given is None:
            return await asyncio.to_thread(sync.enqueue_many, items)
        # on the loop, in the caller's transaction: first renew the id reservation in a
        # thread if due, so the write itself does no blocking I/O of ax's own
        await asyncio.to_thread(sync.ids.next_ids, 0)
        return await given.run_sync(lambda conn: sync.enqueue_many(items, connection=conn))

    async def get(self, task_id: int) -> TaskView:
        """The task ``task_id`` (from the archive tables, ``archived=True``, if archived).

        Raises:
            TaskNotFound: no such task.
        """
        if self._store is None:
            return await self._threaded(lambda sync: sync.get(task_id))
        return await self._store.run(self._mover.get, task_id)

    async def wait(self, task_id: int, timeout: float = 30.0) -> TaskView:
        """Wait until the task has finished (SUCCESS, FAILED or CANCELLED); returns it.

        On PostgreSQL the end's notification wakes it, with a read of the row at least
        every :data:`~ax_kombu.store.waits.SAFETY_POLL_S` seconds; on SQLite it polls,
        from 10 ms backing off to 0.5 s.

        Raises:
            TaskNotFound: no such task.
            WaitTimeout: it had not finished after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        if self._store is None:
            return await _poll(lambda: self.get(task_id), task_id, timeout, deadline)
        async with self._end_listener().watch(task_id) as woken:
            while True:
                view = _final_or_none(await self.get(task_id), timeout, deadline)
                if view is not None:
                    return view
                await woken.wait(min(deadline - time.monotonic(), SAFETY_POLL_S))

    def _end_listener(self) -> AsyncEndListener:
        if self._listener is None:
            self._listener = AsyncEndListener(libpq_url(self.settings.database_url))
        return self._listener

    async def cancel(self, task_id: int | None = None, *, task_type: str | None = None,
                     biz_key: str | None = None) -> TaskView:
        """Cancel a task that has not finished, by id or by ``(task_type, biz_key)``.

        Raises:
            ValidationError: neither or both ways of naming the task given.
            TaskNotFound: no such task.
            IllegalTransition: the task has already finished.
        """
        return await self._move(lambda mover: mover.cancel(task_id, task_type=task_type,
                                                           biz_key=biz_key))

    async def reschedule(self, task_id: int | None = None, *, task_type: str | None = None,
                         biz_key: str | None = None, run_at: datetime | None = None,
                         delay: Any = None, payload: Any = UNCHANGED) -> TaskView:
        """Move a task that has not started to ``run_at`` (or ``delay`` from now), with
        ``payload`` if given; see :func:`ax_kombu.reschedule`.

        Raises:
            ValidationError: bad arguments; nothing changed.
            TaskNotFound: no such task.
            TooLateToMove: it is claimed, staged for its start, or running.
            IllegalTransition: it has finished.
        """
        return await self._move(lambda mover: mover.reschedule(
            task_id, task_type=task_type, biz_key=biz_key, run_at=run_at, delay=delay,
            payload=payload))

    async def run_now(self, task_id: int | None = None, *, task_type: str | None = None,
                      biz_key: str | None = None) -> TaskView:
        """Move a task that has not started to now; raises as :meth:`reschedule`."""
        return await self._move(lambda mover: mover.run_now(task_id, task_type=task_type,
                                                            biz_key=biz_key))

    async def _move(self, call: Callable[[Moving], TaskView]) -> TaskView:
        if self._store is None:
            return await self._threaded(call)
        await self._store.fresh_ms()  # the mover reads the clock as measured, without I/O
        return await self._store.run(call, self._mover)

    async def _threaded(self, call: Callable[[Client], T]) -> T:
        sync = await self._sync_client()
        return await asyncio.to_thread(call, sync)

    async def _sync_client(self) -> Client:
        """The SQLite store's sync client, made in a thread (it may migrate the file)."""
        async with self._sync_made:
            if self._sync is None:
                self._sync = await asyncio.to_thread(Client, self.settings)
            return self._sync

    async def aclose(self) -> None:
        """Close the listener, the engine (PostgreSQL) or the sync client (SQLite), and
        give back the id reservation."""
        if self._listener is not None:
            await self._listener.aclose()
        if self._store is not None:
            await self._store.aclose()
        if self._sync is not None:
            await asyncio.to_thread(self._sync.close)
            self._sync = None


async def _rows_of(settings: Settings, now: int, items: Iterable[Mapping[str, Any]]
                   ) -> list[list[dict[str, Any]]]:
    """Each item's validated rows (:func:`ax_kombu.api.item_rows`), yielding to the loop
    every :data:`_SLICE_S` of work."""
    groups = []
    mark = time.perf_counter()
    for index, item in enumerate(items):
        groups.append(item_rows(settings, now, index, item, None))
        if time.perf_counter() - mark > _SLICE_S:
            await asyncio.sleep(0)
            mark = time.perf_counter()
    return groups


async def _results(groups: list[list[dict[str, Any]]], written: list[Written]
                   ) -> list[TaskId]:
    """:func:`ax_kombu.api.task_ids`, a few hundred items at a time with a yield between;
    each step also frees its items' rows (``groups`` is emptied), as freeing ten thousand
    rows at once would hold the loop as long as building them."""
    out: list[TaskId] = []
    done = 0
    for start in range(0, len(groups), _RESULTS_PER_STEP):
        step = groups[start:start + _RESULTS_PER_STEP]
        size = sum(len(group) for group in step)
        out += task_ids(step, written[done:done + size])
        done += size
        for group in step:
            group.clear()
        await asyncio.sleep(0)
    return out


def _final_or_none(view: TaskView, timeout: float, deadline: float) -> TaskView | None:
    """``view`` if its task has finished; None if there is time left to wait.

    Raises:
        WaitTimeout: it has not finished and the deadline has passed.
    """
    if view.status in states.FINAL:
        return view
    if deadline - time.monotonic() <= 0:
        raise WaitTimeout(f"task {view.task_id} is still {view.status} after {timeout} s")
    return None


async def _poll(read: Callable[[], Awaitable[TaskView]], task_id: int, timeout: float,
                deadline: float) -> TaskView:
    """Read until the task has finished, from 10 ms backing off to 0.5 s."""
    pause = 0.01
    while True:
        view = _final_or_none(await read(), timeout, deadline)
        if view is not None:
            return view
        await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause = min(pause * 2, 0.5)


# -- the module-level API: one client per event loop and process -------------------------------

_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[dict[str, Any], AsyncClient]]
_clients = weakref.WeakKeyDictionary()
_closing: set[asyncio.Task[None]] = set()


def client() -> AsyncClient:
    """The running loop's client in this process, made on first use from the settings
    :func:`ax_kombu.client` uses (made again after :func:`ax_kombu.configure` or a fork).

    Raises:
        RuntimeError: no event loop is running.
    """
    loop = asyncio.get_running_loop()
    wanted = dict(config.process_overrides)
    found = _clients.get(loop)
    if found is not None and found[0] == wanted and found[1].pid == os.getpid():
        return found[1]
    if found is not None and found[1].pid == os.getpid():
        closing = loop.create_task(found[1].aclose())  # settings changed: the old one closes
        _closing.add(closing)  # kept until done (the loop keeps only a weak reference)
        closing.add_done_callback(_closing.discard)
    made = AsyncClient(from_env(**wanted))
    _clients[loop] = (wanted, made)
    return made


async def aclose() -> None:
    """Close the running loop's client (the next call makes a new one)."""
    found = _clients.pop(asyncio.get_running_loop(), None)
    if found is not None:
        await found[1].aclose()


async def enqueue(task_type: str, payload: Any = None, *, connection: Any = None,
                  **options: Any) -> TaskId:
    """:func:`ax_kombu.enqueue`, awaited (same arguments, returns and errors)."""
    return await client().enqueue(task_type, payload, connection=connection, **options)


async def enqueue_many(items: Iterable[Mapping[str, Any]], *,
                       connection: Any = None) -> list[TaskId]:
    """:func:`ax_kombu.enqueue_many`, awaited."""
    return await client().enqueue_many(items, connection=connection)


async def get(task_id: int) -> TaskView:
    """:func:`ax_kombu.get`, awaited. Raises TaskNotFound."""
    return await client().get(task_id)


async def wait(task_id: int, timeout: float = 30.0) -> TaskView:
    """:func:`ax_kombu.wait`, awaited. Raises TaskNotFound, or WaitTimeout."""
    return await client().wait(task_id, timeout)


async def cancel(task_id: int | None = None, *, task_type: str | None = None,
                 biz_key: str | None = None) -> TaskView:
    """:func:`ax_kombu.cancel`, awaited (same errors)."""
    return await client().cancel(task_id, task_type=task_type, biz_key=biz_key)


async def reschedule(task_id: int | None = None, *, task_type: str | None = None,
                     biz_key: str | None = None, run_at: datetime | None = None,
                     delay: Any = None, payload: Any = UNCHANGED) -> TaskView:
    """:func:`ax_kombu.reschedule`, awaited (same errors)."""
    return await client().reschedule(task_id, task_type=task_type, biz_key=biz_key,
                                     run_at=run_at, delay=delay, payload=payload)


async def run_now(task_id: int | None = None, *, task_type: str | None = None,
                  biz_key: str | None = None) -> TaskView:
    """:func:`ax_kombu.run_now`, awaited (same errors)."""
    return await client().run_now(task_id, task_type=task_type, biz_key=biz_key)
