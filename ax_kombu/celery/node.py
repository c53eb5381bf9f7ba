"""One Celery worker as an ax node: its store in each process, its incarnation, its beats.

Used by :class:`ax_kombu.celery.fence.Fence`. Contracts:

* **One node per Celery worker** (``celery@<hostname>``), registered and heartbeated by the
  worker's main process through the one node lifecycle every ax daemon uses
  (:class:`ax_kombu.node.lifecycle.NodeLifecycle`): a beat refused (the worker was declared
  dead, e.g. paused past the silence window) revokes the lease and registers a new
  incarnation, keeping the ax tasks this process still runs; a failed beat is logged and
  counted, and the next one comes an interval later.
* **The incarnation is shared with the pool's children**: it lives in a page of shared
  memory made before the pool forks, so prefork children fence with the one their parent
  has now, not the one of their fork.
* **A store per process**: each process (prefork children included) opens its own on first
  use; one inherited through a fork is kept referenced, never closed (its connections are
  the parent's).
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, select

from ax_kombu.config import Settings
from ax_kombu.core.lease import Lease
from ax_kombu.node.lifecycle import NodeLifecycle
from ax_kombu.store import Store
from ax_kombu.store.engine import make_engine
from ax_kombu.store.nodes import Heartbeat, TakeOver
from ax_kombu.store.schema import nodes

log = logging.getLogger(__name__)
_INT64 = struct.Struct("q")
#: how often a start refused for a dead incarnation looks for the next one
POLL_S = 0.05


class SharedIncarnation:
    """The node's live incarnation, in a page of memory shared with the processes forked
    after it was made (an anonymous ``mmap`` is ``MAP_SHARED``)."""

    def __init__(self) -> None:
        self._page = mmap.mmap(-1, _INT64.size)

    def get(self) -> int:
        return int(_INT64.unpack_from(self._page, 0)[0])

    def set(self, incarnation: int) -> None:
        _INT64.pack_into(self._page, 0, incarnation)


class ProcessStore:
    """The store of the calling process (see the module docstring).

    Args:
        settings: ax's settings (``AX_*``).
        pool_size: database connections kept open per process (the worker's concurrency
            and its own threads); default: the store's.
    """

    def __init__(self, settings: Settings, pool_size: int | None = None) -> None:
        self._settings = settings
        self._pool_size = pool_size
        self._store: Store | None = None
        self._pid = 0
        self._inherited: list[Store] = []
        self._lock = threading.Lock()

    def get(self) -> Store:
        """This process's store, opened on first use."""
        with self._lock:
            if self._store is None or self._pid != os.getpid():
                if self._store is not None:
                    self._inherited.append(self._store)
                self._store, self._pid = self._open(), os.getpid()
            return self._store

    def _open(self) -> Store:
        """A store whose pool is sized for ``pool_size`` threads at once: the default pool
        (5, overflow closed on return) would open and close a PostgreSQL connection per run
        at the worker's concurrency."""
        store = Store(self._settings)
        if self._pool_size and store.engine.dialect.name == "postgresql":
            store.engine.dispose()
            store.engine = make_engine(self._settings.database_url, pool_size=self._pool_size)
        return store

    @contextmanager
    def one_statement(self) -> Iterator[Connection]:
        """A connection for one statement that commits alone: in autocommit on PostgreSQL
        (one round trip, not three: the start and the end of every run go through here,
        on the worker's pool threads), in a transaction elsewhere."""
        engine = self.get().engine
        if engine.dialect.name != "postgresql":
            with engine.begin() as conn:
                yield conn
            return
        with engine.connect() as conn:
            yield conn.execution_options(isolation_level="AUTOCOMMIT")


class CeleryNode:
    """The ax node of one Celery worker (see the module docstring).

    Args:
        settings: ax's settings (``AX_*``).
        node_id: the ax node name of the worker.
        stores: the store of each process.
        running: the ax task ids this process runs now (kept RUNNING by a re-registration).
        on_registered: told of each registration (the first and each after a refused beat),
            before the shared incarnation names the new one.
        on_beat: called after each beat that did not fail.
    """

    def __init__(self, settings: Settings, node_id: str, stores: ProcessStore,
                 running: Callable[[], Collection[int]] = tuple,
                 on_registered: Callable[[], None] = lambda: None,
                 on_beat: Callable[[], None] = lambda: None) -> None:
        self.settings = settings
        self.node_id = node_id
        self._stores = stores
        self._running = running
        self._on_registered = on_registered
        self._on_beat = on_beat
        #: the worker's main process: made before its pool forks any child
        self.main_pid = os.getpid()
        self.incarnation = SharedIncarnation()
        #: how long this process may still start under its incarnation (its beats)
        self.lease = Lease(settings.lease_s)
        self.lifecycle: NodeLifecycle | None = None
        self._stop = threading.Event()

    def register(self, queues: list[str]) -> None:
        """Become an ax node and heartbeat (on a daemon thread) until the process exits."""
        info = {"celery": True, "celery_queues": queues}
        heartbeat = Heartbeat(self._stores.get(), self.node_id, "worker",
                              silence_ms=self.settings.silence_ms)
        self.lifecycle = lifecycle = NodeLifecycle(
            heartbeat, self.lease, lambda: info, keep_running=self._running,
            on_registered=self._registered)
        lifecycle.register()
        threading.Thread(target=self._beat, args=(lifecycle,), name="ax-celery-heartbeat",
                         daemon=True).start()
        atexit.register(self.unregister)

    def _registered(self, _: TakeOver) -> None:
        self._on_registered()
        assert self.lifecycle is not None
        self.incarnation.set(self.lifecycle.incarnation)

    def _beat(self, lifecycle: NodeLifecycle) -> None:
        try:
            lifecycle.beat_every(self.settings.heartbeat_interval_s, self._stop, self._on_beat)
        except Exception:  # the name was taken by a live process: no more beats here
            log.exception("ax heartbeat stopped", extra={"node": self.node_id})

    def unregister(self) -> None:
        """Stop beating and mark the node stopped (a clean exit: nothing runs any more)."""
        self._stop.set()
        lifecycle, self.lifecycle = self.lifecycle, None  # once
        if lifecycle is not None and self.main_pid == os.getpid():
            try:
                lifecycle.stop()
            except Exception:  # the process is exiting; the silence window covers it
                log.warning("could not mark the ax node stopped", exc_info=True)

    def in_pool_child(self) -> bool:
        """Whether this is a pool process forked by the registered main process (prefork)."""
        return os.getpid() != self.main_pid

    def live(self, incarnation: int) -> bool:
        """Whether ``incarnation`` is this node's live one in the store now."""
        with self._stores.get().engine.connect() as conn:
            return conn.execute(select(nodes.c.node_id).where(
                nodes.c.node_id == self.node_id, nodes.c.incarnation == incarnation,
                nodes.c.stopped_at.is_(None))).first() is not None

    def next_incarnation(self, stale: int) -> int | None:
        """Wait up to the silence window for an incarnation after ``stale``."""
        deadline = time.monotonic() + self.settings.silence_ms / 1000
        while time.monotonic() < deadline:
            current = self.incarnation.get()
            if current != stale:
                return current
            time.sleep(POLL_S)
        return None
