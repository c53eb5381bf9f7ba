"""A pinned connection: one database connection a writer thread keeps open between batches."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError


class PinnedConnection:
    """One database connection kept by one thread between batches.

    A batch then costs its statement and commit only, not a pool checkout and
    its liveness ping. After an error the connection is dropped and the next
    :meth:`begin` opens a new one. With ``autocommit`` (PostgreSQL only), each
    statement commits by itself: one round trip instead of two, for callers
    whose statements are each atomic and independent of one another.
    """

    def __init__(self, engine: Engine, *, autocommit: bool = False) -> None:
        self.engine = engine
        self.autocommit = autocommit and engine.dialect.name == "postgresql"
        self._conn: Connection | None = None

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """A transaction on the pinned connection, committed when the block exits
        (in autocommit: the connection, each statement committed as it runs)."""
        if self._conn is None or self._conn.closed or self._conn.invalidated:
            conn = self.engine.connect()
            self._conn = (conn.execution_options(isolation_level="AUTOCOMMIT")
                          if self.autocommit else conn)
        try:
            if self.autocommit:
                yield self._conn
            else:
                with self._conn.begin():
                    yield self._conn
        except SQLAlchemyError:
            self.close()
            raise

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except SQLAlchemyError:
                pass
