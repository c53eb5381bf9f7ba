"""``enqueue(..., connection=)``: the task commits or rolls back with the caller's own
transaction, on every kind of connection the issue names, and bad connections are refused
with nothing written (:mod:`ax_kombu.store.borrowed`).

On PostgreSQL: a SQLAlchemy Connection and Session, psycopg2 and psycopg 3 connections; on
SQLite: a SQLAlchemy connection to the same file. The firing of a late commit is in
tests/e2e/test_moves_e2e.py (real processes)."""

from __future__ import annotations

import select
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import psycopg2
import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from ax_kombu.api import Client
from ax_kombu.config import from_env
from ax_kombu.exceptions import TaskNotFound, ValidationError
from ax_kombu.store.engine import make_engine, migrate
from ax_kombu.store.tasks import WAKE_CHANNEL

pytestmark = [pytest.mark.timeout(60)]


def _dsn(url: str) -> str:
    """A libpq DSN for a ``postgresql://`` URL of the test database."""
    return url.replace("postgresql+psycopg2://", "postgresql://")


@pytest.fixture
def pg_client(pg_url: str) -> Iterator[Client]:
    client = Client(from_env({}, database_url=pg_url))
    yield client
    client.close()


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    """The caller's own engine on the ax database (as an app would make it)."""
    engine = create_engine(_dsn(pg_url).replace("postgresql://", "postgresql+psycopg2://"))
    yield engine
    engine.dispose()


def _count(client: Client, task_id: int) -> int:
    """How many rows another session sees for ``task_id`` (task, dedup entry, ax_due)."""
    with client.store.engine.connect() as conn:
        return sum(conn.execute(text(f"SELECT count(*) FROM {table} WHERE task_id = :t"),
                                {"t": task_id}).scalar_one()
                   for table in ("ax_task", "ax_fingerprint", "ax_due"))


def _raw(kind: str, url: str) -> Any:
    if kind == "psycopg2":
        return psycopg2.connect(_dsn(url))
    return psycopg.connect(_dsn(url))


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["psycopg2", "psycopg"])
def test_a_raw_connection_commits_and_rolls_back_with_the_caller(
        pg_client: Client, pg_url: str, kind: str) -> None:
    raw = _raw(kind, pg_url)
    try:
        with raw.cursor() as cur:  # the app's own write, in the same transaction
            cur.execute("CREATE TEMP TABLE orders (id int)")
            cur.execute("INSERT INTO orders VALUES (42)")
        kept = pg_client.enqueue("order.close", {"order": 42}, delay=60, connection=raw)
        many = pg_client.enqueue_many([{"task_type": "t", "payload": {"i": i}, "delay": 60}
                                       for i in range(40)], connection=raw)  # COPY path
        assert kept.created and all(t.created for t in many)
        assert _count(pg_client, kept) == 0, "seen by another session before the commit"
        raw.commit()
        assert _count(pg_client, kept) == 3  # the task, its dedup entry, its ax_due entry
        assert pg_client.get(many[-1]).payload == {"i": 39}

        gone = pg_client.enqueue("order.close", {"order": 43}, delay=60, connection=raw)
        gone_many = pg_client.enqueue_many([{"task_type": "t", "payload": {"j": i}}
                                            for i in range(30)], connection=raw)
        raw.rollback()
        assert _count(pg_client, gone) == 0
        with pytest.raises(TaskNotFound):
            pg_client.get(gone_many[0])
        # the rolled-back task left no duplicate-check entry: the same task is created anew
        again = pg_client.enqueue("order.close", {"order": 43}, delay=60)
        assert again.created
    finally:
        raw.close()


@pytest.mark.integration
def test_a_sqlalchemy_connection_and_session_carry_the_task(pg_client: Client,
                                                            pg_engine: Engine) -> None:
    with pg_engine.connect() as conn:
        conn.execute(text("CREATE TEMP TABLE orders (id int)"))
        conn.execute(text("INSERT INTO orders VALUES (1)"))
        dropped = pg_client.enqueue("t", {"n": 1}, connection=conn)
        conn.rollback()
        kept = pg_client.enqueue("t", {"n": 2}, connection=conn)
        conn.commit()
    assert _count(pg_client, dropped) == 0 and _count(pg_client, kept) == 3

    with Session(pg_engine) as session:
        in_session = pg_client.enqueue("t", {"n": 3}, delay=5, connection=session)
        assert _count(pg_client, in_session) == 0
        session.commit()
    with Session(pg_engine) as session:
        rolled = pg_client.enqueue("t", {"n": 4}, connection=session)
        session.rollback()
    assert _count(pg_client, in_session) == 3 and _count(pg_client, rolled) == 0


@pytest.mark.integration
def test_the_schedulers_are_woken_at_the_commit_not_before(pg_client: Client,
                                                           pg_url: str) -> None:
    """NOTIFY is transactional: a listener hears the wake-up only once the caller commits."""
    listener = psycopg2.connect(_dsn(pg_url))
    listener.autocommit = True
    raw = psycopg2.connect(_dsn(pg_url))
    try:
        with listener.cursor() as cur:
            cur.execute(f"LISTEN {WAKE_CHANNEL}")
        pg_client.enqueue("t", {"soon": True}, delay=0.2, connection=raw)
        listener.poll()
        assert listener.notifies == []
        raw.commit()
        for _ in range(100):  # up to 5 s
            if listener.notifies:
                break
            select.select([listener], [], [], 0.05)
            listener.poll()
        assert listener.notifies and listener.notifies[0].channel == WAKE_CHANNEL
    finally:
        raw.close()
        listener.close()


@pytest.mark.integration
def test_biz_key_duplicates_stay_exact_across_open_transactions(pg_client: Client,
                                                                pg_url: str) -> None:
    """A second producer's enqueue of the same biz_key waits for the first transaction's
    outcome (the advisory lock is kept to its end): after its commit, a duplicate; after a
    rollback, a new task."""
    first, second = psycopg2.connect(_dsn(pg_url)), psycopg2.connect(_dsn(pg_url))
    other = Client(from_env({}, database_url=pg_url))
    try:
        pending = pg_client.enqueue("coupon", {"u": 7}, biz_key="xmas-7", connection=first)
        got: list[Any] = []
        waiter = threading.Thread(target=lambda: got.append(
            other.enqueue("coupon", {"u": 7}, biz_key="xmas-7", connection=second)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive(), "the second producer did not wait for the first's lock"
        first.commit()
        waiter.join(10)
        second.commit()
        assert got and got[0] == pending and got[0].duplicate

        third = pg_client.enqueue("coupon", {"u": 8}, biz_key="xmas-8", connection=first)
        waiter = threading.Thread(target=lambda: got.append(
            other.enqueue("coupon", {"u": 8}, biz_key="xmas-8", connection=second)))
        waiter.start()
        waiter.join(0.5)
        first.rollback()
        waiter.join(10)
        second.commit()
        assert got[1] != third and got[1].created
    finally:
        first.close()
        second.close()
        other.close()


@pytest.mark.integration
def test_bad_connections_are_refused_and_write_nothing(pg_client: Client, pg_url: str) -> None:
    before = _tasks(pg_client)
    other_db = psycopg2.connect(_dsn(pg_url).rsplit("/", 1)[0] + "/postgres")
    autocommit = psycopg2.connect(_dsn(pg_url))
    autocommit.autocommit = True
    try:
        with pytest.raises(ValidationError, match="another database"):
            pg_client.enqueue("t", {}, connection=other_db)
        with pytest.raises(ValidationError, match="autocommit"):
            pg_client.enqueue("t", {}, connection=autocommit)
        with pytest.raises(ValidationError, match="must be a SQLAlchemy Connection"):
            pg_client.enqueue("t", {}, connection=object())
        with pytest.raises(ValidationError, match="payload"):  # validation before any write
            pg_client.enqueue("t", {"x": float("nan")}, connection=autocommit)
    finally:
        other_db.close()
        autocommit.close()
    assert _tasks(pg_client) == before


def _tasks(client: Client) -> int:
    with client.store.engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM ax_task")).scalar_one())


def test_sqlite_takes_a_connection_to_the_same_file_only(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ax.db'}"
    migrate(make_engine(url))
    client = Client(from_env({}, database_url=url))
    mine = create_engine(url)
    elsewhere = create_engine(f"sqlite:///{tmp_path / 'other.db'}")
    try:
        with mine.connect() as conn:
            dropped = client.enqueue("t", {"n": 1}, connection=conn)
            conn.rollback()
            kept = client.enqueue("t", {"n": 2}, connection=conn)
            conn.commit()
        assert _count(client, dropped) == 0 and _count(client, kept) == 3
        with elsewhere.connect() as conn, pytest.raises(ValidationError, match="another"):
            client.enqueue("t", {}, connection=conn)
        with pytest.raises(ValidationError, match="SQLite"):
            client.enqueue("t", {}, connection=_FakePsycopg())
    finally:
        client.close()
        mine.dispose()
        elsewhere.dispose()


class _FakePsycopg:
    """Shaped like a psycopg 3 connection by its module: refused on SQLite before use."""

    __module__ = "psycopg"
    autocommit = False


@pytest.mark.integration
def test_a_transaction_above_read_committed_is_refused(pg_client: Client, pg_url: str) -> None:
    raw = psycopg2.connect(_dsn(pg_url))
    try:
        raw.set_session(isolation_level="REPEATABLE READ")
        with pytest.raises(ValidationError, match="repeatable read.*READ COMMITTED"):
            pg_client.enqueue("t", {"iso": 1}, connection=raw)
        raw.rollback()
    finally:
        raw.close()
    assert _tasks(pg_client) == 0
