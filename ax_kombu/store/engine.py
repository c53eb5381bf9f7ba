"""Engines for PostgreSQL (production) and SQLite (embedded default), and migrations.

SQLite is made safe for several processes: WAL journal (readers never block
the writer), a 30 s busy timeout, and every transaction opened with
``BEGIN IMMEDIATE`` so a transaction that will write takes the write lock up
front instead of failing with "database is locked" when it upgrades.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.exc import ArgumentError, OperationalError

from ax_kombu.config import redact_url
from ax_kombu.exceptions import ConfigurationError, StoreError

log = logging.getLogger(__name__)

_MIGRATIONS = Path(__file__).with_name("migrations")

_NOW_SQL = {
    "postgresql": "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
    "sqlite": "SELECT CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)",
}


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for ``url`` (``postgresql://…`` or ``sqlite:///path``).

    Raises:
        ConfigurationError: the URL names a database ax does not support.
    """
    try:
        if url.startswith("sqlite"):
            return _sqlite_engine(url, **kwargs)
        if url.startswith("postgres"):
            url = re.sub(r"^postgres(ql)?://", "postgresql+psycopg2://", url)
            return create_engine(url, pool_size=kwargs.pop("pool_size", 5),
                                 max_overflow=10, **kwargs)
    except ArgumentError as exc:
        raise ConfigurationError(f"bad database URL {redact_url(url)}: {exc}") from None
    raise ConfigurationError(f"unsupported database URL {redact_url(url)} "
                             "(use postgresql://… or sqlite:///path)")


def _sqlite_engine(url: str, **kwargs: Any) -> Engine:
    if url in ("sqlite://", "sqlite:///:memory:"):
        raise ConfigurationError("an in-memory SQLite database cannot be shared between "
                                 "processes; give a file path, e.g. sqlite:///ax.sqlite3")
    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False},
                           **kwargs)

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # ax issues BEGIN itself, below
        cursor = dbapi_conn.cursor()
        for pragma in ("journal_mode=WAL", "busy_timeout=30000", "synchronous=NORMAL"):
            cursor.execute(f"PRAGMA {pragma}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def db_now_ms(conn: Any) -> int:
    """The database clock, in epoch milliseconds."""
    return int(conn.execute(text(_NOW_SQL[conn.dialect.name])).scalar_one())


def migrate(engine: Engine, revision: str = "head") -> None:
    """Upgrade the schema to ``revision`` (idempotent; safe to run concurrently).

    Raises:
        StoreError: the database cannot be reached.
    """
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(7341000001)"))
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    except OperationalError as exc:
        raise StoreError(f"cannot migrate {redact_url(str(engine.url))}: {exc.orig}") from None


def current_revision(engine: Engine) -> str | None:
    """The schema revision the database is at, or None before the first migration."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()
