"""Writing inside the caller's own transaction: ``enqueue(..., connection=conn)``.

What a caller may pass, and what ax does with it:

* a SQLAlchemy ``Connection`` — used as it is (its transaction, or the one it begins
  for the statement, as it would for any of the caller's statements);
* a SQLAlchemy ``Session`` — ``session.connection()``: the session's transaction;
* a psycopg2 or psycopg 3 connection — wrapped (:class:`Borrowing`) in a SQLAlchemy
  ``Connection`` whose dialect never begins, commits, rolls back or closes it;
* Django's ``django.db.connection`` — its driver connection, inside ``atomic()``.

**What holds on this path.** ax issues no BEGIN, COMMIT or ROLLBACK of its own and never
retries a statement inside the caller's transaction: a failure is raised to the caller,
whose transaction it may have aborted (PostgreSQL), as any failed statement of theirs
would. The task, its duplicate-check entry and its ``ax_due`` entry are written by the
caller's transaction, so they commit or roll back with it, and no other session sees them
before the commit. Duplicate protection (``biz_key``, fingerprint) stays exact: the
advisory locks of :mod:`ax_kombu.store.tasks` are transaction-scoped, so **they are kept
until the caller's transaction ends**, and another producer enqueuing a task whose key
or fingerprint falls in the same lock bucket waits for that commit (keep such
transactions short). On SQLite the first statement takes the database's write lock, kept
likewise until the caller commits.

**Which database.** The connection must reach the database the ax store uses:
PostgreSQL — the same database of the same server (its name, the server's start time and
port agree); SQLite — the same file. Anything else is a :class:`ValidationError`, and
nothing was written. A connection in autocommit mode is refused the same way (its writes
could not be rolled back with the caller's), and so is a PostgreSQL transaction above READ
COMMITTED: under REPEATABLE READ or SERIALIZABLE the duplicate check would read the
transaction's first snapshot, blind to a producer that committed the same key meanwhile.
"""

from __future__ import annotations

import contextvars
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2
from sqlalchemy.pool import NullPool

from ax_kombu.exceptions import ValidationError

#: one round trip: what names the database (the first three), and the transaction's isolation
_PG_IDENTITY = text("SELECT current_database(), "
                    "CAST(pg_postmaster_start_time() AS TEXT), current_setting('port'), "
                    "current_setting('transaction_isolation')")
_AUTOCOMMIT = ("connection= is in autocommit mode: ax's writes would commit on their own, not "
               "with your transaction (turn autocommit off, or with Django enqueue inside "
               "transaction.atomic())")

#: the driver connection being borrowed, for the borrowing engine's ``creator``
_lent: contextvars.ContextVar[Any] = contextvars.ContextVar("ax_lent_connection")


class _Lent:
    """Dialect behaviour for a connection ax borrows: the owner begins, commits, rolls
    back and closes it; on connecting ax changes nothing about it (no type casters
    registered, no session settings)."""

    def on_connect(self) -> None:
        return None

    def do_begin(self, dbapi_connection: Any) -> None:
        pass

    def do_commit(self, dbapi_connection: Any) -> None:
        pass

    def do_rollback(self, dbapi_connection: Any) -> None:
        pass

    def do_close(self, dbapi_connection: Any) -> None:
        pass

    def do_terminate(self, dbapi_connection: Any) -> None:
        pass

    def reset_isolation_level(self, dbapi_connection: Any) -> None:
        pass


class LentPsycopg2(_Lent, PGDialect_psycopg2):
    """psycopg2, borrowed."""

    supports_statement_cache = True


class LentPsycopg(_Lent, PGDialect_psycopg):
    """psycopg 3, borrowed."""

    supports_statement_cache = True


registry.register("postgresql.ax_lent_psycopg2", __name__, "LentPsycopg2")
registry.register("postgresql.ax_lent_psycopg", __name__, "LentPsycopg")


class Borrowing:
    """Turns a caller's connection into a SQLAlchemy ``Connection`` in its transaction,
    after checking it reaches ``store``'s database. One per producer client; thread-safe
    (the connection being lent travels in a context variable)."""

    def __init__(self, store: Engine) -> None:
        self._store = store
        self._engines: dict[str, Engine] = {}
        self._identity: tuple[Any, ...] | None = None

    @contextmanager
    def connection(self, given: Any) -> Iterator[Connection]:
        """The SQLAlchemy connection to write through, inside ``given``'s transaction.

        Raises:
            ValidationError: ``given`` is not a supported connection, is in autocommit
                mode, or reaches another database; nothing was written.
        """
        given = _unwrap_django(given)
        if isinstance(given, Connection):
            self._check(given)
            yield given
            return
        session_connection = _session_connection(given)
        if session_connection is not None:
            self._check(session_connection)
            yield session_connection
            return
        engine = self._engine_for(given)
        token = _lent.set(given)
        try:
            with engine.connect() as conn:
                self._check(conn)
                yield conn
        finally:
            _lent.reset(token)

    def close(self) -> None:
        for engine in self._engines.values():
            engine.dispose()
        self._engines.clear()

    def _engine_for(self, raw: Any) -> Engine:
        driver = _driver_of(raw)
        if getattr(raw, "autocommit", False) is True:
            raise ValidationError(_AUTOCOMMIT)
        if self._store.dialect.name != "postgresql":
            raise ValidationError(
                f"connection= got a {driver} connection, but the ax store is SQLite; pass a "
                "SQLAlchemy Connection or Session on the ax database file")
        engine = self._engines.get(driver)
        if engine is None:
            engine = create_engine(f"postgresql+ax_lent_{driver}://", creator=_lent.get,
                                   poolclass=NullPool)
            self._engines[driver] = engine
        return engine

    def _check(self, conn: Connection) -> None:
        """Raise ValidationError unless ``conn`` is on the store's database, in a
        transaction that can roll back."""
        if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
            raise ValidationError(_AUTOCOMMIT)
        if conn.dialect.name != self._store.dialect.name:
            raise ValidationError(f"connection= is on {conn.dialect.name}, the ax store on "
                                  f"{self._store.dialect.name}: pass a connection to the ax "
                                  "database")
        theirs, isolation = _identity(conn)
        if isolation not in (None, "read committed"):
            raise ValidationError(
                f"connection= is in a {isolation} transaction: ax's duplicate check must "
                "see producers that committed while it waited for their lock, which only "
                "READ COMMITTED does; enqueue from a READ COMMITTED transaction")
        if theirs != self._store_identity():
            self._identity = None  # the store's server may have restarted: ask once more
            if theirs != self._store_identity():
                raise ValidationError(
                    f"connection= reaches another database ({_show(theirs)}) than the ax "
                    f"store ({_show(self._store_identity())}); nothing was written")

    def _store_identity(self) -> tuple[Any, ...]:
        if self._identity is None:
            with self._store.connect() as conn:
                self._identity = _identity(conn)[0]
        return self._identity


def _identity(conn: Connection) -> tuple[tuple[Any, ...], str | None]:
    """What names a database — PostgreSQL: its name, the server's start time and port;
    SQLite: the real path of the main database file — and the transaction's isolation level
    (PostgreSQL; None on SQLite, whose writers are serialised)."""
    if conn.dialect.name == "postgresql":
        *names, isolation = conn.execute(_PG_IDENTITY).one()
        return tuple(names), str(isolation)
    for _seq, name, path in conn.exec_driver_sql("PRAGMA database_list"):
        if name == "main":
            return ("sqlite", os.path.realpath(path) if path else ":memory:"), None
    return ("sqlite", None), None


def _show(identity: tuple[Any, ...]) -> str:
    if identity[0] == "sqlite":
        return f"file {identity[1]}"
    return f"database {identity[0]!r} on the server listening on port {identity[2]}"


def _session_connection(given: Any) -> Connection | None:
    """``given.connection()`` when ``given`` is a SQLAlchemy ORM Session, else None (the
    ORM is imported only by a caller that uses it)."""
    orm = sys.modules.get("sqlalchemy.orm")
    if orm is not None and isinstance(given, orm.Session):
        found: Connection = given.connection()
        return found
    return None


def _unwrap_django(given: Any) -> Any:
    """Django's ``connection`` (a DatabaseWrapper): its driver connection, once inside
    ``transaction.atomic()``."""
    if not (hasattr(given, "in_atomic_block") and hasattr(given, "ensure_connection")):
        return given
    if not given.in_atomic_block:
        raise ValidationError("connection=django.db.connection outside transaction.atomic(): "
                              "Django would commit ax's writes at once; enqueue inside "
                              "an atomic block")
    given.ensure_connection()
    return given.connection


def _driver_of(raw: Any) -> str:
    """'psycopg2' or 'psycopg' for a driver connection of either; else ValidationError."""
    module = type(raw).__module__.split(".")[0]
    if module in ("psycopg2", "psycopg"):
        return module
    raise ValidationError(
        f"connection= must be a SQLAlchemy Connection or Session, a psycopg2 or psycopg 3 "
        f"connection, or django.db.connection; got {type(raw).__module__}."
        f"{type(raw).__qualname__}")
