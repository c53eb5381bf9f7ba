"""Engines for PostgreSQL (production) and SQLite (embedded default), and migrations.

SQLite is made safe for several processes: WAL journal (readers never block
the writer), a 30 s busy timeout, and every transaction opened with
``BEGIN IMMEDIATE`` so a transaction that will write takes the write lock up
front instead of failing with "database is locked" when it upgrades.

On PostgreSQL every connection ax opens turns the JIT compiler off (``SET jit = off``).
PostgreSQL compiles a statement when the planner's *estimated* cost passes
``jit_above_cost``, and an estimate grows with the table even where the work does not:
on a 10,000,000-row table the schedule delays ``ax status`` reads (a 100,000-row limit on
an index scan that returns a few rows) spent far longer compiling than running
(``python -m bench.bigtable``; docs/benchmarks.md, "Issue 24: ten million rows"). ax's
statements are all short index reads and writes,
the kind PostgreSQL's documentation says JIT does not pay off for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import (
    URL,
    Connection,
    Engine,
    create_engine,
    event,
    literal_column,
    make_url,
    text,
)
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    InternalError,
    NoSuchModuleError,
    OperationalError,
    ProgrammingError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeout

from ax_kombu.exceptions import ConfigurationError, StoreError
from ax_kombu.observability.redaction import redact_url

log = logging.getLogger(__name__)

_MIGRATIONS = Path(__file__).with_name("migrations")

_NOW_SQL = {
    "postgresql": "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
    "sqlite": "SELECT CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)",
}


#: The driver ax uses for a PostgreSQL URL that names none (SQLAlchemy 2.1's default is
#: psycopg 3, which ax does not depend on).
_PG_DRIVER = "psycopg2"
_USE = "use postgresql://user:pass@host/db or sqlite:///path"


def parse_database_url(url: str) -> URL:
    """Parse ``url`` into the SQLAlchemy URL ax will open, without loading anything.

    ``postgres://`` and ``postgresql://`` without a driver mean
    ``postgresql+psycopg2://``; a driver given explicitly is kept. libpq's multi-host
    form, ``postgresql://user@h1:p1,h2:p2/db?target_session_attrs=read-write``, is
    accepted (see :func:`_hosts_to_query`).

    Raises:
        ConfigurationError: ``url`` is malformed, names a database other than
            PostgreSQL or SQLite, or an in-memory SQLite database.
    """
    try:
        parsed = make_url(_hosts_to_query(url))
    except ArgumentError:
        raise ConfigurationError(f"not a database URL: {redact_url(url)!r} ({_USE})") from None
    except ValueError:  # make_url raises it for one thing: a port that is not a number
        raise ConfigurationError(f"malformed database URL {redact_url(url)!r}: the port is "
                                 "not a number (%-encode ':', '@' and '/' in a user name "
                                 "or password)") from None
    backend, _, driver = parsed.drivername.partition("+")
    if backend in ("postgres", "postgresql"):
        return parsed.set(drivername=f"postgresql+{driver or _PG_DRIVER}")
    if backend != "sqlite":
        raise ConfigurationError(f"unsupported database {backend!r} in "
                                 f"{redact_url(url)!r} ({_USE})")
    if parsed.database in (None, "", ":memory:"):
        raise ConfigurationError("an in-memory SQLite database cannot be shared between "
                                 "processes; give a file path, e.g. sqlite:///ax.sqlite3")
    return parsed


def _hosts_to_query(url: str) -> str:
    """libpq's multi-host URL, ``postgresql://user@h1:p1,h2:p2/db?…``, in the form
    SQLAlchemy parses, ``postgresql://user@/db?host=h1,h2&port=p1,p2&…``; any other URL
    unchanged. libpq tries the hosts in turn; with ``target_session_attrs=read-write`` it
    passes over a standby, so after a failover new connections reach the promoted one.
    A host without a port gets libpq's default port; an IPv6 address goes in brackets.

    Raises:
        ConfigurationError: a host is empty, a port is not a number, or the query
            names ``host`` or ``port`` as well.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme.startswith("postgres"):
        return url
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    userinfo, at, hosts = rest[:cut].rpartition("@")
    if "," not in hosts:
        return url
    names, ports = zip(*(_host_and_port(url, entry) for entry in hosts.split(",")),
                       strict=True)
    path, _, query = rest[cut:].partition("?")
    if any(pair.partition("=")[0] in ("host", "port") for pair in query.split("&")):
        raise ConfigurationError(f"database URL {redact_url(url)!r} names hosts both before "
                                 "the path and as host= or port= in the query; use one")
    listed = "host=" + ",".join(names) + ("&port=" + ",".join(ports) if any(ports) else "")
    return f"{scheme}://{userinfo}{at}{path or '/'}?{listed}{'&' if query else ''}{query}"


def _host_and_port(url: str, entry: str) -> tuple[str, str]:
    """``host[:port]`` or ``[v6 address][:port]`` of a multi-host URL: (host, port or "")."""
    if entry.startswith("["):
        name, bracket, port = entry[1:].partition("]")
        port = port.removeprefix(":") if bracket and port[:1] in ("", ":") else "?"
    else:
        name, _, port = entry.partition(":")
    if not name or not (port == "" or port.isdigit()):
        raise ConfigurationError(f"malformed database URL {redact_url(url)!r}: {entry!r} is "
                                 "not host, host:port or [v6 address]:port")
    return name, port


def check_database_url(url: str) -> None:
    """Fail now, not at the first query, if ``url`` cannot be opened by this installation.

    Parses the URL (:func:`parse_database_url`), loads its SQLAlchemy dialect
    and imports the DBAPI module the dialect drives. Nothing connects: an
    unreachable server passes here and is met, with retries, by the store.

    Raises:
        ConfigurationError: the URL is malformed or unsupported, its driver is
            unknown to SQLAlchemy, or the driver's module is not installed.
    """
    parsed = parse_database_url(url)
    try:
        dialect = parsed.get_dialect()
    except NoSuchModuleError:
        raise ConfigurationError(f"unknown database driver {parsed.drivername!r} in "
                                 f"{redact_url(url)!r} ({_USE})") from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        raise ConfigurationError(f"the {parsed.drivername} driver cannot be loaded: {exc}"
                                 ) from None


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for ``url`` (``postgresql://…`` or ``sqlite:///path``).

    Raises:
        ConfigurationError: the URL is malformed or names a database ax does
            not support (see :func:`parse_database_url`), or SQLAlchemy
            refuses its options.
    """
    parsed = parse_database_url(url)
    try:
        if parsed.get_backend_name() == "sqlite":
            return _sqlite_engine(parsed, **kwargs)
        return _postgresql_engine(parsed, **kwargs)
    except (ArgumentError, NoSuchModuleError) as exc:
        raise ConfigurationError(f"bad database URL {redact_url(url)}: {exc}") from None


def _postgresql_engine(url: URL, **kwargs: Any) -> Engine:
    engine = create_engine(url, pool_size=kwargs.pop("pool_size", 5), max_overflow=10,
                           **kwargs)

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        cursor = dbapi_conn.cursor()  # no JIT: see the module's docstring
        cursor.execute("SET jit = off")
        cursor.close()
        dbapi_conn.commit()  # a SET outlives its transaction; any DBAPI driver

    return engine


def _sqlite_engine(url: URL, **kwargs: Any) -> Engine:
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


@contextmanager
def one_statement(engine: Engine) -> Iterator[Connection]:
    """A connection for a single write that must hold no lock after the client is gone: on
    PostgreSQL it is in autocommit (the server commits the statement before it answers),
    so a host cut off between the statement and its COMMIT cannot leave the row locked in
    an orphaned transaction until the server notices the dead connection (hours, with the
    default TCP keepalives) — a node's heartbeat row locked so would block every
    scheduler's judging of that very node. Elsewhere (SQLite, one process), a transaction."""
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            yield conn.execution_options(isolation_level="AUTOCOMMIT")
    else:
        with engine.begin() as conn:
            yield conn


def now_ms_sql(dialect: str) -> Any:
    """The database clock in epoch ms as an SQL expression (for a statement that must not
    read it first in a statement of its own)."""
    return literal_column(_NOW_SQL[dialect].removeprefix("SELECT "))


def db_now_ms(conn: Any) -> int:
    """The database clock, in epoch milliseconds."""
    return int(conn.execute(text(_NOW_SQL[conn.dialect.name])).scalar_one())


#: PostgreSQL's clock to the microsecond, for measuring the offset (:mod:`ax_kombu.store.clock`)
_PRECISE_NOW_SQL = "SELECT EXTRACT(EPOCH FROM clock_timestamp()) * 1000"


def db_now_precise_ms(conn: Any) -> float:
    """The PostgreSQL clock in epoch milliseconds, to the microsecond (:func:`db_now_ms`
    rounds to whole milliseconds, which would put a clock measured with it up to half a
    millisecond ahead)."""
    return float(conn.execute(text(_PRECISE_NOW_SQL)).scalar_one())


def alembic_config() -> Config:
    """Alembic's configuration for ax's migrations (the caller gives the connection as
    ``cfg.attributes["connection"]``)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    return cfg


def migrate(engine: Engine, revision: str = "head") -> None:
    """Upgrade the schema to ``revision`` (idempotent; safe to run concurrently).

    Raises:
        StoreError: the database cannot be reached.
    """
    cfg = alembic_config()
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


def lost_connection(error: BaseException) -> bool:
    """Whether a failed write is worth retrying as it is: the store could not be reached
    or could not run the statement (a lost connection, a lock or statement timeout, a
    missing table or privilege), none of which a smaller batch would change. Anything
    else (a DataError or IntegrityError, a value the driver cannot send) is a refusal of
    the batch's data."""
    if isinstance(error, DBAPIError) and error.connection_invalidated:
        return True
    return isinstance(error, (OperationalError, InterfaceError, ProgrammingError, InternalError,
                              DisconnectionError, PoolTimeout, OSError))
