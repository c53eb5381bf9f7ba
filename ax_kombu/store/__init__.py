"""The durable task store: SQLAlchemy schema, the SQL that claims and dedups, migrations.

PostgreSQL (psycopg2) is the production store; SQLite is the embedded
default. Both run the same statements except where a faster PostgreSQL form
exists (COPY, ``FOR UPDATE SKIP LOCKED``, advisory locks).
"""

from __future__ import annotations

import time

from sqlalchemy import Engine

from ax_kombu.config import Settings
from ax_kombu.store.clock import DbClock
from ax_kombu.store.engine import db_now_ms, db_now_precise_ms, make_engine, migrate


class Store:
    """An engine, the database clock read through it, and the schema kept current."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine: Engine = make_engine(settings.database_url)
        if settings.is_sqlite or settings.auto_migrate:
            migrate(self.engine)
        self.clock = DbClock(self._read_clock)

    def _read_clock(self) -> float:
        if self.engine.dialect.name == "sqlite":
            return time.time_ns() / 1_000_000  # an embedded database shares our clock
        with self.engine.connect() as conn:
            return db_now_precise_ms(conn)

    def now_ms(self) -> int:
        """The database clock now (epoch ms)."""
        return self.clock.now_ms()

    def close(self) -> None:
        self.engine.dispose()


__all__ = ["Store", "db_now_ms", "make_engine", "migrate"]
