"""SQLite transport for Kombu: a broker with no server.

Messages live in one SQLite file.  Every process on the same machine that
opens the same file shares the same queues, so an ``ax-scheduler`` process
can publish while one or more ``ax-worker`` processes consume, with nothing
else running.

Features
========
* Type: Virtual
* Supports Direct: yes
* Supports Topic: yes
* Supports Fanout: no
* Supports Priority: yes (0-9, higher is delivered first; FIFO within a
  priority)
* Supports TTL: no
* Works across processes: yes (same host, local filesystem)

Connection String
=================

.. code-block::

    ax+sqlite:///relative/path/broker.db
    ax+sqlite:////absolute/path/broker.db

Call :func:`ax_kombu.broker.transports.register` first: it maps the ``ax`` prefix to
this module.  Kombu splits the URL at the first ``+`` (as for
``sqla+postgresql://...``); what follows is read like an SQLAlchemy SQLite
URL: three slashes then a relative path, four slashes for an absolute one.
A relative path is resolved against the working directory when the
connection is created, so give every process the same absolute path.  The
parent directory is created if missing.  An empty path, a host part
(``sqlite://host/x.db``), a query string and ``:memory:`` are rejected with
:class:`ValueError` (use ``memory://`` for an in-process broker).  Options
go in ``transport_options``, not in the URL.

Transport Options
=================
* ``polling_interval``: seconds an idle consumer sleeps between polls
  (default ``0.01``).  A message published to an idle queue is therefore
  seen after at most about 10 ms (5 ms on average) plus one short indexed
  query; a busy consumer does not sleep at all.  An idle consumer costs
  about 100 indexed reads per second per queue, and never takes the write
  lock (measured figures: docs/benchmarks.md, "Figures moved out of the
  code").  Kombu's own default for virtual transports is 1
  second.
* ``visibility_timeout``: seconds (default ``None``: off).  When set, a
  message taken by a consumer stays in the database, invisible, until it is
  acked (deleted) or rejected/restored (visible again at once); if it is
  neither within ``visibility_timeout`` seconds, e.g. because the consumer
  was killed, it becomes visible again in its original place and is
  redelivered with ``delivery_info['redelivered'] = True``.  Costs one extra
  write per message (the ack).  Use one setting for every process sharing
  the file.
* ``busy_timeout``: seconds to wait for the database write lock before
  raising ``sqlite3.OperationalError`` (default ``30``).  Kombu treats that
  error as a connection error, so ``ensure``/retry policies apply.
* ``synchronous``: SQLite ``PRAGMA synchronous`` (``NORMAL`` by default,
  ``FULL`` or ``EXTRA`` to survive power loss, see Guarantees).
* ``body_encoding``, ``deadletter_queue``: as for every Kombu virtual
  transport.

Guarantees
==========
Each message is one row.  Publishing is one ``INSERT``, committed before
``publish()`` returns.  Taking a message is one ``DELETE ... RETURNING``
statement (``UPDATE ... RETURNING`` with a visibility timeout), and a single
statement is atomic in SQLite, so however many processes consume, a message
is handed to exactly one of them.  Concurrent producers and consumers in
separate processes lose and duplicate nothing (the test suite checks this
with 3 producer and 3 consumer processes exchanging 9,000 messages).

Acks are handled by Kombu's virtual QoS: a delivered, unacked message is kept
in the consuming process.  What survives what:

* Producer crash: nothing already published is lost (``publish()`` returned
  only after the commit).  A publish interrupted mid-way is not stored.
* Consumer closes its connection/channel cleanly (or the interpreter exits
  normally) with unacked messages: they are restored to the queue they were
  taken from and delivered to the next consumer, marked
  ``delivery_info['redelivered']``.  Without ``visibility_timeout`` they go
  to the back of their queue; with it they keep their place.  ``reject``
  with ``requeue=True`` behaves the same.  (Unlike Kombu's default, which
  re-routes through the exchange and drops the message when the consuming
  process never declared that exchange.)
* Consumer killed (SIGKILL, SIGTERM without a handler, power loss) after
  taking a message but before acking it:

  - without ``visibility_timeout`` (default): the message is **lost in the
    transport** (it was deleted when taken).  ax_kombu recovers it one level
    up: the task is still unacknowledged in the product's database, which
    dispatches it again when its ack timeout expires.  The same holds for
    every message the killed process had taken but not acked (prefetch).
  - with ``visibility_timeout``: it becomes visible again, in its original
    place, once the timeout expires, and is redelivered.

* Consumer still working when ``visibility_timeout`` expires: the message is
  delivered a second time (at-least-once).  Choose a timeout longer than the
  longest task, or leave it off and rely on the product's ack timeout.
* OS crash or power loss: with ``synchronous=NORMAL`` (WAL mode) the last
  transactions committed before the crash may be rolled back; use
  ``synchronous=FULL`` for durability at some cost in throughput.

Caveats
=======
* Exchanges and bindings live in each process's memory, as with Kombu's
  ``memory``, ``filesystem`` and ``sqlalchemy`` transports: only the queue
  contents are shared.  A producer must either publish to the default
  exchange with ``routing_key=<queue name>`` or declare the queue (and its
  binding) itself, e.g. ``producer.publish(..., declare=[queue])``;
  otherwise a message routed through an exchange the producer does not know
  is dropped.
* Local filesystems only: SQLite's WAL mode does not work over NFS/SMB.
* Prefer connecting after ``fork()``.  A connection inherited by a forked
  child opens its own database handle there (SQLite handles must not cross
  a fork), but the two processes then share kombu state they cannot
  coordinate, such as unacked messages.
* ``queue_declare(passive=True)`` always succeeds: queues exist implicitly.
* The visibility timeout uses the wall clock (``time.time()``), shared by
  all processes; stepping the clock forward can cause early redelivery.
* Throughput is bounded by SQLite's single writer (docs/benchmarks.md,
  "Figures moved out of the code"); with a visibility timeout an ack is a
  second write.  More processes share, rather than add to, that rate.

Storage
=======
Table ``ax_kombu_message`` (``id``, ``queue``, ``priority``, ``payload``
JSON, ``visible_at``, ``deliveries``), indexed on
``(queue, priority DESC, id)``; created on first use.  The database runs in
WAL mode, so readers never block the writer.  The schema and every statement
are in :mod:`ax_kombu.broker.sqlite_store`.
"""
# Kombu's virtual transport API is largely unannotated.
# mypy: disallow-untyped-calls=False
from __future__ import annotations

import os
import sqlite3
import threading
import time
from queue import Empty
from typing import Any

from kombu.transport import virtual
from kombu.utils.json import dumps

from ax_kombu.broker.sqlite_store import (
    DELETE,
    INSERT,
    LEASE,
    PROBE,
    PURGE,
    RELEASE,
    SETTLE,
    SIZE,
    SYNCHRONOUS,
    TAKE,
    URL_PREFIX,
    Taken,
    open_database,
    parse_url,
    unpack,
)

__all__ = ['URL_PREFIX', 'Channel', 'Transport', 'parse_url']


class Channel(virtual.Channel):  # type: ignore[misc]  # kombu is untyped
    """One SQLite connection, opened on first use."""

    from_transport_options = (
        *virtual.Channel.from_transport_options,
        'visibility_timeout', 'busy_timeout', 'synchronous',
    )
    visibility_timeout: float | None = None
    busy_timeout: float = 30.0
    synchronous: str = 'NORMAL'

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        self._path: str = connection.db_path
        self._db: sqlite3.Connection | None = None
        self._db_pid = 0
        self._lock = threading.Lock()
        self._taken: dict[str, Taken] = {}  # by delivery tag
        self._no_ack_queues: set[str] = set()
        super().__init__(connection, **kwargs)
        self._check_options()

    def _check_options(self) -> None:
        self.synchronous = str(self.synchronous).upper()
        if self.synchronous not in SYNCHRONOUS:
            raise ValueError(f'synchronous must be one of {sorted(SYNCHRONOUS)}')
        if self.visibility_timeout is not None:
            self.visibility_timeout = float(self.visibility_timeout)
            if self.visibility_timeout <= 0:
                raise ValueError('visibility_timeout must be > 0 or None')
        self.busy_timeout = float(self.busy_timeout)

    # -- database access (call with self._lock taken) -------------------------

    def _conn(self) -> sqlite3.Connection:
        if self._db is not None and self._db_pid != os.getpid():
            # Inherited across fork(): never touch the parent's handle.
            _ABANDONED.append(self._db)
            self._db = None
        if self._db is None:
            self._db = open_database(self._path, self.busy_timeout, self.synchronous)
            self._db_pid = os.getpid()
        return self._db

    def _execute(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        with self._lock:
            return self._conn().execute(sql, params).fetchall()

    def _write(self, sql: str, params: tuple[Any, ...]) -> int:
        with self._lock:
            return self._conn().execute(sql, params).rowcount

    def ensureopen_database(self) -> None:
        """Open the database now (schema included) to surface errors early."""
        with self._lock:
            self._conn()

    # -- virtual channel API ---------------------------------------------------

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        priority = self._get_message_priority(message)
        self._write(INSERT, (queue, priority, dumps(message)))

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        return self._take(queue, tracked=queue not in self._no_ack_queues)

    def _take(self, queue: str, tracked: bool) -> dict[str, Any]:
        """Take the next message; ``tracked`` if it will be acked."""
        lease = self.visibility_timeout if tracked else None
        now = time.time()
        with self._lock:
            db = self._conn()
            # Plain read first: an empty poll never takes the write lock.
            if not db.execute(PROBE, (queue, now)).fetchall():
                raise Empty()
            if lease:
                rows = db.execute(LEASE, (now + lease, queue, now)).fetchall()
            else:
                rows = db.execute(TAKE, (queue, now)).fetchall()
        if not rows:
            raise Empty()
        payload = unpack(rows[0])
        if tracked:
            tag = payload['properties']['delivery_tag']
            self._taken[tag] = Taken(queue, *rows[0][2:])
        return payload

    def _size(self, queue: str) -> int:
        return int(self._execute(SIZE, (queue, time.time()))[0][0])

    def _purge(self, queue: str) -> int:
        return self._write(PURGE, (queue, time.time()))

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self._write(DELETE, (queue,))

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        """Queues exist implicitly: nothing to create."""

    def queue_delete(self, queue: str, if_unused: bool = False,
                     if_empty: bool = False, **kwargs: Any) -> None:
        """Delete the queue's messages even if it has no bindings here."""
        if if_empty and self._size(queue):
            return
        super().queue_delete(queue, if_unused=if_unused, **kwargs)
        self._delete(queue)

    # -- acknowledgements ------------------------------------------------------

    def basic_consume(self, queue: str, no_ack: bool, *args: Any,
                      **kwargs: Any) -> Any:
        if no_ack:
            self._no_ack_queues.add(queue)
        return super().basic_consume(queue, no_ack, *args, **kwargs)

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._tag_to_queue.values():
            self._no_ack_queues.discard(queue)
        return result

    def basic_get(self, queue: str, no_ack: bool = False,
                  **kwargs: Any) -> Any:
        try:
            payload = self._take(queue, tracked=not no_ack)
        except Empty:
            return None
        message = self.Message(payload, channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def basic_ack(self, delivery_tag: str, multiple: bool = False) -> None:
        self._settle(delivery_tag)
        super().basic_ack(delivery_tag, multiple)

    def basic_reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if not requeue:
            self._settle(delivery_tag)
        super().basic_reject(delivery_tag, requeue=requeue)

    def _settle(self, delivery_tag: str) -> None:
        """Forget an acked message; delete it if it is only leased."""
        taken = self._taken.pop(delivery_tag, None)
        if taken is not None and taken.row_id is not None:
            self._write(SETTLE, (taken.row_id,))

    def _restore(self, message: Any) -> None:
        """Make an unacked message available again in its own queue.

        Kombu's default re-routes through the exchange, which drops the
        message if this process never declared that exchange.
        """
        taken = self._taken.pop(message.delivery_tag, None)
        if taken is None:
            super()._restore(message)
        elif taken.row_id is not None:
            self._write(RELEASE, (taken.row_id, taken.lease))
        else:
            payload = message.serializable()
            payload['redelivered'] = True
            self._put(taken.queue, payload)

    def close(self) -> None:
        try:
            super().close()  # restores unacked messages first
        finally:
            with self._lock:
                db, self._db = self._db, None
                if db is not None and self._db_pid == os.getpid():
                    db.close()
            self._taken.clear()


#: Handles inherited across fork(); kept referenced so they are never closed
#: (closing them in the child could disturb the parent's locks).
_ABANDONED: list[sqlite3.Connection] = []


class Transport(virtual.Transport):  # type: ignore[misc]  # kombu is untyped
    """Kombu transport storing queues in a SQLite file (``ax+sqlite://``)."""

    Channel = Channel

    polling_interval = 0.01
    default_port = None
    can_parse_url = True
    driver_type = 'sqlite'
    driver_name = 'sqlite3'
    connection_errors = (
        *virtual.Transport.connection_errors, sqlite3.OperationalError,
    )

    def __init__(self, client: Any, **kwargs: Any) -> None:
        self.db_path = parse_url(client.hostname)
        super().__init__(client, **kwargs)

    def establish_connection(self) -> Transport:
        """Open the database at connect time, so bad paths fail early."""
        super().establish_connection()
        channel = self._avail_channels[-1]
        try:
            channel.ensureopen_database()
        except BaseException:
            self._avail_channels.remove(channel)
            channel.close()
            raise
        return self

    def driver_version(self) -> str:
        return sqlite3.sqlite_version
