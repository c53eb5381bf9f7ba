"""The SQLite file behind the ``ax+sqlite://`` transport: URL, schema, statements.

:mod:`ax_kombu.broker.sqlite` documents the transport and holds its Kombu
classes; this module holds what touches the file itself, so every statement
the transport runs can be read in one place.

Guarantees the statements give the transport:

* taking a message is one statement (``DELETE ... RETURNING``, or
  ``UPDATE ... RETURNING`` under a visibility timeout), atomic in SQLite, so
  a message is handed to exactly one taker however many processes poll;
* ``id`` never repeats (``AUTOINCREMENT``), so settling or releasing by id
  cannot touch a newer message;
* ``visible_at`` is 0 for a ready message and the lease expiry time
  (``time.time()``) for one taken under a visibility timeout; every read
  that looks for work compares it with "now", so an expired lease is simply
  visible again.
"""
from __future__ import annotations

import os
import sqlite3
from typing import Any, NamedTuple

from kombu.utils.json import loads

URL_PREFIX = 'ax+sqlite://'
_SCHEME = 'sqlite://'
TABLE = 'ax_kombu_message'
#: The values ``PRAGMA synchronous`` accepts.
SYNCHRONOUS = frozenset({'OFF', 'NORMAL', 'FULL', 'EXTRA'})

_SCHEMA = (
    (f'CREATE TABLE IF NOT EXISTS {TABLE} ('
     ' id INTEGER PRIMARY KEY AUTOINCREMENT,'
     ' queue TEXT NOT NULL,'
     ' priority INTEGER NOT NULL DEFAULT 0,'
     ' payload TEXT NOT NULL,'
     ' visible_at REAL NOT NULL DEFAULT 0,'
     ' deliveries INTEGER NOT NULL DEFAULT 0)'),
    (f'CREATE INDEX IF NOT EXISTS {TABLE}_next'
     f' ON {TABLE} (queue, priority DESC, id)'),
)
_NEXT = (f'SELECT id FROM {TABLE} WHERE queue = ? AND visible_at <= ?'
         ' ORDER BY priority DESC, id LIMIT 1')
#: ``(queue, now)``: is anything visible? A plain read, never the write lock.
PROBE = f'SELECT 1 FROM {TABLE} WHERE queue = ? AND visible_at <= ? LIMIT 1'
#: ``(queue, now)``: remove the next message -> ``(payload, deliveries)``.
TAKE = (f'DELETE FROM {TABLE} WHERE id = ({_NEXT})'
        ' RETURNING payload, deliveries + 1')
#: ``(lease expiry, queue, now)``: hide the next message until the expiry
#: -> ``(payload, deliveries, id, lease expiry)``.
LEASE = (f'UPDATE {TABLE} SET visible_at = ?, deliveries = deliveries + 1'
         f' WHERE id = ({_NEXT}) RETURNING payload, deliveries, id, visible_at')
#: ``(queue, priority, payload)``.
INSERT = f'INSERT INTO {TABLE} (queue, priority, payload) VALUES (?, ?, ?)'
#: ``(id,)``: an acked leased message.
SETTLE = f'DELETE FROM {TABLE} WHERE id = ?'
#: ``(id, lease expiry)``: visible again at once, unless re-leased meanwhile.
RELEASE = f'UPDATE {TABLE} SET visible_at = 0 WHERE id = ? AND visible_at = ?'
#: ``(queue, now)``.
SIZE = f'SELECT count(*) FROM {TABLE} WHERE queue = ? AND visible_at <= ?'
#: ``(queue, now)``: visible messages only; leased ones stay.
PURGE = f'DELETE FROM {TABLE} WHERE queue = ? AND visible_at <= ?'
#: ``(queue,)``: every message of the queue.
DELETE = f'DELETE FROM {TABLE} WHERE queue = ?'
_HAS_TABLE = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"


class Taken(NamedTuple):
    """Where an unacked message came from, so it can be settled/restored."""

    queue: str
    row_id: int | None = None   # set when leased (visibility timeout) ...
    lease: float | None = None  # ... with the lease's expiry time


def parse_url(hostname: str | None) -> str:
    """Return the absolute database path named by ``sqlite:///<path>``.

    ``hostname`` is what Kombu leaves after splitting ``ax+`` off the URL.

    Raises:
        ValueError: not such a URL, or it has a query string, a host part,
            an empty or directory path, or names ``:memory:``.
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


def open_database(path: str, busy_timeout: float, synchronous: str) -> sqlite3.Connection:
    """Open ``path`` in WAL mode, creating its directory and the schema if needed.

    The connection is in autocommit mode (``isolation_level=None``): each
    statement above is its own transaction.

    Raises:
        sqlite3.OperationalError: the file cannot be opened, or WAL mode
            cannot be enabled (e.g. on a network filesystem).
    """
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
    if db.execute(_HAS_TABLE, (TABLE,)).fetchall():
        return
    db.execute('BEGIN IMMEDIATE')
    try:
        for statement in _SCHEMA:
            db.execute(statement)
    except BaseException:
        db.execute('ROLLBACK')
        raise
    db.execute('COMMIT')


def unpack(row: tuple[Any, ...]) -> dict[str, Any]:
    """Decode a taken row ``(payload, delivery count, ...)``.

    A message delivered before (count above 1, or restored with the
    ``redelivered`` mark) gets ``delivery_info['redelivered'] = True``.
    """
    payload: dict[str, Any] = loads(row[0])
    if row[1] > 1 or payload.get('redelivered'):
        props = payload.setdefault('properties', {})
        props.setdefault('delivery_info', {})['redelivered'] = True
    return payload
