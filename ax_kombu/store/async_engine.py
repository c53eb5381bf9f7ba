"""The store on SQLAlchemy's asyncio engine, for the async producer (:mod:`ax_kombu.aio`).

PostgreSQL only (the embedded SQLite store needs no async driver: :mod:`ax_kombu.aio` runs
the sync client in a thread). The driver is psycopg 3's async connection
(``postgresql+psycopg``, made from the configured ``postgresql://`` or
``postgresql+psycopg2://`` URL), or asyncpg when the URL names it
(``postgresql+asyncpg://``) and it is installed.

**The SQL is the store's own, unchanged.** Every statement runs in a function written for
a sync ``Connection`` (:func:`~ax_kombu.store.enqueue.write_tasks`,
:mod:`~ax_kombu.store.moves`, the id reservation, the database clock), handed the sync
facade SQLAlchemy gives an async connection (``run_sync``, ``greenlet_spawn``): the
driver's I/O is awaited on the event loop, in no thread.

**What keeps the loop responsive:**

* The database clock (:class:`~ax_kombu.store.clock.DbClock`) and the id reservation
  (:class:`~ax_kombu.core.ids.ReservedIds`) keep a ``threading.Lock`` while they measure
  or reserve: two coroutines inside them at once would block the loop's thread for good.
  :meth:`AsyncStore.guarded` lets one coroutine at a time in (an ``asyncio.Lock``);
  between measurements they do no I/O and release it at once.
* A batch is written in slices of :data:`SLICE` rows, each a
  :func:`~ax_kombu.store.enqueue.write_tasks` call in the batch's one transaction: the CPU
  work between two awaited round trips stays small. Rows of an earlier slice are in the
  table when a later one checks for duplicates, as earlier rows of one batch are. The
  batch's advisory locks are all taken first, in one sorted statement, as a sync batch's
  are: slices taking theirs one after another could deadlock with another batch. Ids are
  reserved a few hundred at a time, with a yield between.
* A client's calls take turns (:attr:`AsyncStore.turns`, :data:`POOL` at work at once, the
  pool's size): between two looks at its timers the loop runs the ready step of every call
  at work, so their number bounds how long anything else on the loop waits; a call
  waiting for its turn has done no work yet.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import URL, Connection, event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.util import greenlet_spawn

from ax_kombu.config import Settings
from ax_kombu.core.ids import ReservedIds
from ax_kombu.exceptions import ConfigurationError, ValidationError
from ax_kombu.observability.redaction import redact_url
from ax_kombu.store import Store
from ax_kombu.store.borrowed import Borrowing
from ax_kombu.store.clock import DbClock
from ax_kombu.store.engine import db_now_precise_ms, make_engine, migrate, parse_database_url
from ax_kombu.store.enqueue import LOCK_KEYS, Written, row_lock_keys, write_tasks
from ax_kombu.store.leases import StoreReserver

T = TypeVar("T")

#: rows per ``write_tasks`` call, small enough that a call's CPU work stays around a
#: millisecond. The store writes more than twenty rows with COPY, which reaches an asyncio
#: driver through :mod:`ax_kombu.store.async_copy` (``enqueue._copy`` calls it).
SLICE = 50
#: connections of the async engine's pool, and calls at work at once: a call's CPU work,
#: not the round trips, bounds a client's rate on a nearby server, and every call at work
#: adds its step to each turn of the loop
POOL = 2
#: ids reserved per step of a large batch (each step runs without yielding)
_IDS_PER_STEP = 250
#: rows whose lock keys are hashed between two yields to the loop
_HASHES_PER_YIELD = 250

def async_url(database_url: str) -> URL:
    """The SQLAlchemy URL of the async engine for ``database_url`` (a PostgreSQL one).

    Raises:
        ConfigurationError: a SQLite URL, or a driver without an asyncio twin, or asyncpg
            named but not installed.
    """
    parsed = parse_database_url(database_url)
    if parsed.get_backend_name() != "postgresql":
        raise ConfigurationError("the async engine serves PostgreSQL; SQLite runs the sync "
                                 "client in a thread")
    driver = parsed.get_driver_name()
    if driver in ("psycopg2", "psycopg", "psycopg_async"):
        return parsed.set(drivername="postgresql+psycopg")
    if driver == "asyncpg":
        if importlib.util.find_spec("asyncpg") is None:
            raise ConfigurationError(f"{redact_url(database_url)} names asyncpg, which is not "
                                     "installed")
        return parsed
    raise ConfigurationError(f"no asyncio driver for {parsed.drivername!r} in "
                             f"{redact_url(database_url)}; use postgresql:// (psycopg 3) or "
                             "postgresql+asyncpg://")


def libpq_url(database_url: str) -> str:
    """``database_url`` as libpq reads it (no SQLAlchemy driver name), for a listener."""
    parsed = parse_database_url(database_url).set(drivername="postgresql")
    return parsed.render_as_string(hide_password=False)


def _no_jit(dbapi_conn: Any, _record: Any) -> None:
    """As :mod:`ax_kombu.store.engine` does for every connection ax opens (see there why)."""
    cursor = dbapi_conn.cursor()
    cursor.execute("SET jit = off")
    cursor.close()
    dbapi_conn.commit()


class LoopStore(Store):
    """A :class:`~ax_kombu.store.Store` whose engine is an async engine's sync facade (usable
    inside ``greenlet_spawn`` / ``run_sync`` only) and whose :meth:`now_ms` never does I/O:
    it reads the clock as last measured, which :meth:`AsyncStore.fresh_ms` keeps fresh."""

    def __init__(self, settings: Settings, engine: AsyncEngine, clock: DbClock) -> None:
        self.settings = settings
        self.engine = engine.sync_engine
        self.clock = clock

    def now_ms(self) -> int:
        return int(self.clock.local_ms())

    def close(self) -> None:
        pass  # the AsyncStore disposes of the engine


class AsyncStore:
    """An async engine on the ax database, its clock, and the guard described above. It
    belongs to the event loop that first uses it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine: AsyncEngine = create_async_engine(async_url(settings.database_url),
                                                       pool_size=POOL, max_overflow=0)
        #: the calls at work at once (see the module's docstring)
        self.turns = asyncio.Semaphore(POOL)
        event.listen(self.engine.sync_engine, "connect", _no_jit)
        self.clock = DbClock(self._read_clock)
        self.loop_store = LoopStore(settings, self.engine, self.clock)
        self._guard = asyncio.Lock()
        self._migrated = not settings.auto_migrate
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.ids = ReservedIds(StoreReserver(self.engine.sync_engine), owner,
                               settings.id_reservation_s * 1000, self.clock.now_ms)
        self.borrowing = Borrowing(self.engine.sync_engine)

    def _read_clock(self) -> float:
        with self.engine.sync_engine.connect() as conn:
            return db_now_precise_ms(conn)

    async def guarded(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the sync facade, one coroutine at a time (migrating first, if
        the settings ask for it)."""
        async with self._guard:
            if not self._migrated:  # alembic's CPU work too: a thread of its own
                await asyncio.to_thread(_migrate, self.settings.database_url)
                self._migrated = True
            return await greenlet_spawn(fn, *args)

    async def fresh_ms(self) -> int:
        """The database clock now (measuring it again when due)."""
        return await self.guarded(self.clock.now_ms)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the sync facade, outside the guard: ``fn`` must not enter the
        clock's or the id reservation's I/O (read :class:`LoopStore`'s clock instead)."""
        return await greenlet_spawn(fn, *args)

    async def assign_ids(self, rows: Sequence[dict[str, Any]]) -> None:
        """Give each row its ``task_id``, a few hundred at a time with a yield between
        (neither the guard nor a reservation between measurements yields)."""
        for start in range(0, len(rows), _IDS_PER_STEP):
            step = rows[start:start + _IDS_PER_STEP]
            ids = await self.guarded(self.ids.next_ids, len(step))
            for row, task_id in zip(step, ids, strict=True):
                row["task_id"] = task_id
            await asyncio.sleep(0)

    async def write(self, given: AsyncConnection | AsyncSession | None,
                    rows: Sequence[Mapping[str, Any]], window_ms: int,
                    wake_before_ms: int | None, now_ms: int) -> list[Written]:
        """:func:`write_batch` in a transaction of its own (``given`` None), committed on
        return, or in the caller's, once :class:`~ax_kombu.store.borrowed.Borrowing` has
        checked it.

        Raises:
            ValidationError: ``given`` is in autocommit mode, in a transaction above READ
                COMMITTED, or on another database; nothing was written.
        """
        if given is None:
            async with self.engine.begin() as conn:
                return await write_batch(conn, rows, window_ms, wake_before_ms, now_ms)
        conn = given if isinstance(given, AsyncConnection) else await given.connection()
        await conn.run_sync(self._check_borrowed)
        return await write_batch(conn, rows, window_ms, wake_before_ms, now_ms)

    def _check_borrowed(self, conn: Connection) -> None:
        with self.borrowing.connection(conn):
            pass

    async def aclose(self) -> None:
        """Give the id reservation back and close the engine."""
        if self.ids.slot is not None:
            await self.guarded(self.ids.release)
        self.borrowing.close()
        await self.engine.dispose()


def async_connection(connection: Any) -> AsyncConnection | AsyncSession | None:
    """``connection=`` as given, if the async producer can write through it.

    Raises:
        ValidationError: anything but None, an AsyncConnection or an AsyncSession.
    """
    if connection is None or isinstance(connection, (AsyncConnection, AsyncSession)):
        return connection
    raise ValidationError(
        "connection= on the async client takes a SQLAlchemy AsyncConnection or AsyncSession "
        f"on the ax database; got {type(connection).__module__}."
        f"{type(connection).__qualname__} (a sync connection goes to ax_kombu.enqueue)")


def _migrate(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        migrate(engine)
    finally:
        engine.dispose()


async def lock_keys(rows: Sequence[Mapping[str, Any]], window_ms: int) -> list[int]:
    """The advisory lock keys :func:`~ax_kombu.store.enqueue.write_tasks` takes for
    ``rows``, sorted, hashed with a yield to the loop every few hundred rows."""
    keys: set[int] = set()
    for start in range(0, len(rows), _HASHES_PER_YIELD):
        keys |= row_lock_keys(rows[start:start + _HASHES_PER_YIELD], window_ms)
        await asyncio.sleep(0)
    return sorted(keys)


async def write_batch(conn: AsyncConnection, rows: Sequence[Mapping[str, Any]],
                      window_ms: int, wake_before_ms: int | None, now_ms: int) -> list[Written]:
    """:func:`~ax_kombu.store.enqueue.write_tasks` for ``rows`` in ``conn``'s transaction,
    by slices (see the module's docstring); nothing begins, commits or retries here.

    Returns:
        For each row, in order, what ``write_tasks`` returns for it.
    """
    if len(rows) > SLICE:
        keys = await lock_keys(rows, window_ms)
        if keys:
            await conn.execute(LOCK_KEYS, {"keys": keys})
    written: list[Written] = []
    for start in range(0, len(rows), SLICE):
        written += await conn.run_sync(write_tasks, rows[start:start + SLICE], window_ms,
                                       wake_before_ms, now_ms)
    return written
