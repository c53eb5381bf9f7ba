"""Fixtures shared by the integration tests: a client on the test's store and the ``ax``
command on it, a dispatcher for the tests that drive a worker with hand-made dispatches,
an empty database for the migration tests, and the console tests' settings and users
(:mod:`tests.integration.console` drives the console)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sqlalchemy import Engine, text

from ax_kombu.api import Client
from ax_kombu.broker.connection import connection, declare_queues
from ax_kombu.config import Settings, from_env
from ax_kombu.store.engine import make_engine
from ax_kombu.web.users import add_user

from ..services import PG_ADMIN_URL, RUN_ID, pg_url_for
from .ax_cli import Ax
from .console import PASSWORDS

if TYPE_CHECKING:
    from .test_worker import Dispatch


@pytest.fixture
def client(settings: Settings) -> Iterator[Client]:
    """A client on this test's store (``settings``), closed afterwards."""
    c = Client(settings)
    yield c
    c.close()


@pytest.fixture
def ax(settings: Settings) -> Ax:
    """The ``ax`` command on this test's store (``settings``)."""
    return Ax(str(settings.database_url))


@pytest.fixture
def web_settings(pg_url: str, tmp_path: Path) -> Settings:
    """The console tests' settings: this run's PostgreSQL database (emptied), a SQLite
    broker. A console test module makes them its ``settings``, so ``client`` is on them."""
    return from_env({}, database_url=pg_url,
                    broker_url=f"ax+sqlite:///{tmp_path / 'broker.sqlite3'}")


@pytest.fixture
def users_env(tmp_path: Path) -> dict[str, str]:
    """``AX_WEB_USERS``: a users file with the console users of
    :data:`tests.integration.console.PASSWORDS`."""
    path = tmp_path / "users"
    for name, (role, password) in PASSWORDS.items():
        add_user(path, name, role, password)
    return {"AX_WEB_USERS": str(path)}


@pytest.fixture
def dispatch(settings: Settings) -> Iterator[Dispatch]:
    """Claims and publishes tasks as a scheduler would, on the test's own queues."""
    from .test_worker import Dispatch

    with connection(settings) as conn:
        declare_queues(conn, settings)
    d = Dispatch(settings)
    yield d
    d.close()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def empty_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """An engine on an empty database (no schema yet), on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        engine = make_engine(f"sqlite:///{tmp_path / 'fresh.sqlite3'}")
        yield engine
        engine.dispose()
        return
    request.getfixturevalue("pg_database")  # skips when PostgreSQL is unavailable
    name = f"ax_test_{RUN_ID}_empty"
    admin = make_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine = make_engine(pg_url_for(name))
    yield engine
    engine.dispose()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()
