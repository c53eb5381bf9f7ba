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
  seen after at most about 10 ms (5 ms on average) plus one query of a
  few tens of microseconds (measured: median 6 ms, 90th percentile 10 ms);
  a busy consumer does not sleep at all.  An idle consumer costs about 100
  indexed reads per second per queue (about 3% of one core), and never
  takes the write lock.  Kombu's own default for virtual transports is 1
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
* Throughput is bounded by SQLite's single writer.  Measured with one
  Kombu process on a 2-core VM: 10,000-12,000 messages/s published and
  7,500-11,000 messages/s consumed and acked (7,000-8,500 with a
  visibility timeout, whose ack is a second write).  More processes share,
  rather than add to, that rate.

Storage
=======
Table ``ax_kombu_message`` (``id``, ``queue``, ``priority``, ``payload``
JSON, ``visible_at``, ``deliveries``), indexed on
``(queue, priority DESC, id)``; created on first use.  The database runs in
WAL mode, so readers never block the writer.
"""
# Kombu's virtual transport API is largely unannotated.
# mypy: disallow-untyped-calls=False
from __future__ import annotations

import os
import sqlite3
import threading
import time
from queue import Empty
from typing import Any, NamedTuple

from kombu.transport import virtual
from kombu.utils.json import dumps, loads

URL_PREFIX = 'ax+sqlite://'
_SCHEME = 'sqlite://'
_TABLE = 'ax_kombu_message'
_SYNCHRONOUS = frozenset({'OFF', 'NORMAL', 'FULL', 'EXTRA'})

_SCHEMA = (
    (f'CREATE TABLE IF NOT EXISTS {_TABLE} ('
     ' id INTEGER PRIMARY KEY AUTOINCREMENT,'
     ' queue TEXT NOT NULL,'
     ' priority INTEGER NOT NULL DEFAULT 0,'
     ' payload TEXT NOT NULL,'
     ' visible_at REAL NOT NULL DEFAULT 0,'
     ' deliveries INTEGER NOT NULL DEFAULT 0)'),
    (f'CREATE INDEX IF NOT EXISTS {_TABLE}_next'
     f' ON {_TABLE} (queue, priority DESC, id)'),
)
# ``id`` never repeats (AUTOINCREMENT), so an ack naming an id cannot hit a
# newer message.  ``visible_at`` is 0 for a ready message and the lease
# expiry time for one taken under a visibility timeout.
_NEXT = (f'SELECT id FROM {_TABLE} WHERE queue = ? AND visible_at <= ?'
         ' ORDER BY priority DESC, id LIMIT 1')
_PROBE = f'SELECT 1 FROM {_TABLE} WHERE queue = ? AND visible_at <= ? LIMIT 1'
_TAKE = (f'DELETE FROM {_TABLE} WHERE id = ({_NEXT})'
         ' RETURNING payload, deliveries + 1')
_LEASE = (f'UPDATE {_TABLE} SET visible_at = ?, deliveries = deliveries + 1'
          f' WHERE id = ({_NEXT}) RETURNING payload, deliveries, id, visible_at')
_INSERT = f'INSERT INTO {_TABLE} (queue, priority, payload) VALUES (?, ?, ?)'
_SETTLE = f'DELETE FROM {_TABLE} WHERE id = ?'
_RELEASE = f'UPDATE {_TABLE} SET visible_at = 0 WHERE id = ? AND visible_at = ?'
_SIZE = f'SELECT count(*) FROM {_TABLE} WHERE queue = ? AND visible_at <= ?'
_PURGE = f'DELETE FROM {_TABLE} WHERE queue = ? AND visible_at <= ?'
_DELETE = f'DELETE FROM {_TABLE} WHERE queue = ?'
_HAS_TABLE = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"


class _Taken(NamedTuple):
    """Where an unacked message came from, so it can be settled/restored."""

    queue: str
    row_id: int | None = None   # set when leased (visibility timeout) ...
    lease: float | None = None  # ... with the lease's expiry time


def parse_url(hostname: str | None) -> str:
    """Return the absolute database path named by ``sqlite:///<path>``.

    ``hostname`` is what Kombu leaves after splitting ``ax+`` off the URL.
    """
    shown = f'ax+{hostname}' if (hostname or '').startswith(_SCHEME) \
        else str(hostname)

    def bad(why: str) -> ValueError:
        return ValueError(
            f'Invalid ax+sqlite URL {shown!r}: {why}; expected '
            f'{URL_PREFIX}/relative/path.db or {URL_PREFIX}//absolute/path.db')

    if not hostname or not hostname.startswith(_SCHEME):
        raise bad('not an ax+sqlite:// URL')
    rest = hostname[len(_SCHEME):]
    if '?' in rest:
        raise bad('query strings are not supported, use transport_options')
    if rest and not rest.startswith('/'):
        raise bad('a host part is not allowed (use three slashes)')
    path = rest[1:]
    if not path.strip('/'):
        raise bad('the database path is empty')
    if path.endswith('/'):
        raise bad('the database path names a directory')
    if path == ':memory:':
        raise bad('an in-memory database cannot be shared, use memory://')
    return os.path.abspath(path)


def _open(path: str, busy_timeout: float, synchronous: str) -> sqlite3.Connection:
    """Open ``path`` in WAL mode, creating the schema if needed."""
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    db = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None,
                         check_same_thread=False)
    try:
        _configure(db, synchronous)
    except BaseException:
        db.close()
        raise
    return db


def _configure(db: sqlite3.Connection, synchronous: str) -> None:
    mode = db.execute('PRAGMA journal_mode = WAL').fetchall()[0][0]
    if str(mode).lower() != 'wal':
        raise sqlite3.OperationalError(
            f'cannot enable WAL mode (got {mode!r}); '
            'is the database on a network filesystem?')
    db.execute(f'PRAGMA synchronous = {synchronous}')
    if db.execute(_HAS_TABLE, (_TABLE,)).fetchall():
        return
    db.execute('BEGIN IMMEDIATE')
    try:
        for statement in _SCHEMA:
            db.execute(statement)
    except BaseException:
        db.execute('ROLLBACK')
        raise
    db.execute('COMMIT')


def _unpack(row: tuple[Any, ...]) -> dict[str, Any]:
    """Decode a taken row ``(payload, delivery count, ...)``."""
    payload: dict[str, Any] = loads(row[0])
    if row[1] > 1 or payload.get('redelivered'):
        props = payload.setdefault('properties', {})
        props.setdefault('delivery_info', {})['redelivered'] = True
    return payload


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
        self._taken: dict[str, _Taken] = {}  # by delivery tag
        self._no_ack_queues: set[str] = set()
        super().__init__(connection, **kwargs)
        self._check_options()

    def _check_options(self) -> None:
        self.synchronous = str(self.synchronous).upper()
        if self.synchronous not in _SYNCHRONOUS:
            raise ValueError(f'synchronous must be one of {sorted(_SYNCHRONOUS)}')
        if self.visibility_timeout is not None:
            self.visibility_timeout = float(self.visibility_timeout)
            if self.visibility_timeout <= 0:
                raise ValueError('visibility_timeout must be > 0 or None')
        self.busy_timeout = float(self.busy_timeout)

    # -- database access (call with self._lock held) -------------------------

    def _conn(self) -> sqlite3.Connection:
        if self._db is not None and self._db_pid != os.getpid():
            # Inherited across fork(): never touch the parent's handle.
            _ABANDONED.append(self._db)
            self._db = None
        if self._db is None:
            self._db = _open(self._path, self.busy_timeout, self.synchronous)
            self._db_pid = os.getpid()
        return self._db

    def _execute(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        with self._lock:
            return self._conn().execute(sql, params).fetchall()

    def _write(self, sql: str, params: tuple[Any, ...]) -> int:
        with self._lock:
            return self._conn().execute(sql, params).rowcount

    def ensure_open(self) -> None:
        """Open the database now (schema included) to surface errors early."""
        with self._lock:
            self._conn()

    # -- virtual channel API ---------------------------------------------------

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        priority = self._get_message_priority(message)
        self._write(_INSERT, (queue, priority, dumps(message)))

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        return self._take(queue, tracked=queue not in self._no_ack_queues)

    def _take(self, queue: str, tracked: bool) -> dict[str, Any]:
        """Take the next message; ``tracked`` if it will be acked."""
        lease = self.visibility_timeout if tracked else None
        now = time.time()
        with self._lock:
            db = self._conn()
            # Plain read first: an empty poll never takes the write lock.
            if not db.execute(_PROBE, (queue, now)).fetchall():
                raise Empty()
            if lease:
                rows = db.execute(_LEASE, (now + lease, queue, now)).fetchall()
            else:
                rows = db.execute(_TAKE, (queue, now)).fetchall()
        if not rows:
            raise Empty()
        payload = _unpack(rows[0])
        if tracked:
            tag = payload['properties']['delivery_tag']
            self._taken[tag] = _Taken(queue, *rows[0][2:])
        return payload

    def _size(self, queue: str) -> int:
        return int(self._execute(_SIZE, (queue, time.time()))[0][0])

    def _purge(self, queue: str) -> int:
        return self._write(_PURGE, (queue, time.time()))

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self._write(_DELETE, (queue,))

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
            self._write(_SETTLE, (taken.row_id,))

    def _restore(self, message: Any) -> None:
        """Make an unacked message available again in its own queue.

        Kombu's default re-routes through the exchange, which drops the
        message if this process never declared that exchange.
        """
        taken = self._taken.pop(message.delivery_tag, None)
        if taken is None:
            super()._restore(message)
        elif taken.row_id is not None:
            self._write(_RELEASE, (taken.row_id, taken.lease))
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
            channel.ensure_open()
        except BaseException:
            self._avail_channels.remove(channel)
            channel.close()
            raise
        return self

    def driver_version(self) -> str:
        return sqlite3.sqlite_version
