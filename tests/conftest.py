"""Shared fixtures: a store URL per backend (SQLite file and a PostgreSQL database of
this run's own), and the settings that point ax at them."""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from ax_kombu.config import Settings, from_env
from ax_kombu.store.engine import make_engine, migrate

from .faults import summary as fault_summary
from .services import (
    AMQP_URL,
    PG_ADMIN_URL,
    REDIS_URL,
    RUN_ID,
    create_rabbit_vhost,
    delete_rabbit_vhost,
    delete_redis_keys,
    own_queues,
    own_redis_broker,
    pg_url_for,
    reachable,
    unavailable,
)

#: the workers this suite starts are single processes (``--processes 1``), each one node,
#: unless a test asks for more: the user's default, ``auto`` (one per core), runs a
#: supervisor, which tests/integration/test_worker_processes.py covers; the node tests
#: count, signal and kill single worker processes
SINGLE_WORKER = {"AX_WORKER_PROCESSES": "1"}
os.environ.update(SINGLE_WORKER)


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A migrated PostgreSQL database that belongs to this test run only."""
    why = reachable(PG_ADMIN_URL, 5432)
    if why:
        unavailable("PostgreSQL", why)
    name = f"ax_test_{RUN_ID}"
    admin = make_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = pg_url_for(name)
    engine = make_engine(url)
    migrate(engine)
    engine.dispose()
    yield url
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="session")
def _pg_cleaner(pg_database: str) -> Iterator[Engine]:
    """One engine for the whole run that empties the database between tests."""
    engine = make_engine(pg_database, pool_size=1)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_url(pg_database: str, _pg_cleaner: Engine) -> str:
    """This run's PostgreSQL database, emptied for the test."""
    with _pg_cleaner.begin() as conn:
        conn.execute(text("TRUNCATE ax_task, ax_node, ax_job, ax_limit, ax_attempt, "
                          "ax_task_archive, ax_attempt_archive, ax_fingerprint, ax_due, ax_move, "
                          "ax_run_log, ax_run_log_archive, ax_audit, ax_audit_archive, ax_alert, ax_pause"))
        conn.execute(text("UPDATE ax_id_lease SET owner = NULL, lease_until = 0"))
    return pg_database


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite store migrated once for the run: each test gets a copy of its own (running
    the migrations for every test cost about half a second each)."""
    path = tmp_path_factory.mktemp("sqlite-template") / "ax.sqlite3"
    engine = make_engine(f"sqlite:///{path}")
    migrate(engine)
    engine.dispose()  # the last connection closed checkpoints the WAL into the main file
    return path


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    """A migrated SQLite store of this test's own (a copy of :func:`sqlite_template`)."""
    path = tmp_path / "ax.sqlite3"
    for suffix in ("", "-wal"):  # a WAL only if the checkpoint at close did not happen
        if Path(f"{sqlite_template}{suffix}").exists():
            shutil.copyfile(f"{sqlite_template}{suffix}", f"{path}{suffix}")
    return f"sqlite:///{path}"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def store_url(request: pytest.FixtureRequest) -> str:
    """Each store test runs twice: on a SQLite file and on PostgreSQL, each migrated and
    the test's own (an emptied database, a copied file)."""
    url: str = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    return url


@pytest.fixture
def settings(store_url: str, tmp_path: Path) -> Settings:
    """Settings on this test's store, ignoring any AX_* variables of the shell."""
    return from_env({}, database_url=store_url, auto_migrate=True,
                    broker_url=f"ax+sqlite:///{tmp_path / 'broker.sqlite3'}")


@pytest.fixture(scope="session")
def rabbit_url() -> Iterator[str]:
    """A RabbitMQ vhost that belongs to this test run only."""
    why = reachable(AMQP_URL, 5672)
    if why:
        unavailable("RabbitMQ", why)
    name = f"ax_test_{RUN_ID}"
    url = create_rabbit_vhost(name)
    yield url
    delete_rabbit_vhost(name)


@pytest.fixture(scope="session")
def redis_url() -> str:
    why = reachable(REDIS_URL, 6379)
    if why:
        unavailable("Redis", why)
    return REDIS_URL


_counter = itertools.count()


def _own_queues() -> dict[str, str]:
    return own_queues(f".t{next(_counter)}")


@pytest.fixture
def redis_broker(redis_url: str) -> Iterator[dict[str, str]]:
    """Redis settings for one test: its own queues under its own key prefix."""
    overrides = own_redis_broker(redis_url, f".t{next(_counter)}")
    yield overrides
    delete_redis_keys(redis_url, overrides["broker_key_prefix"])


@pytest.fixture
def amqp_broker(rabbit_url: str) -> dict[str, str]:
    """RabbitMQ settings for one test: its own queues in this run's vhost."""
    return {**_own_queues(), "broker_url": rabbit_url}


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.integration),
                        pytest.param("amqp", marks=pytest.mark.integration)])
def broker(request: pytest.FixtureRequest) -> dict[str, str]:
    """Broker settings for one test, on Redis and on RabbitMQ."""
    value: dict[str, str] = request.getfixturevalue(f"{request.param}_broker")
    return value


# -- the session: two workers (pytest-xdist), the fault suite's table ---------------------------

#: markers whose tests run one after another on one pytest-xdist worker (``--dist loadgroup``):
#: each fault scenario starts four daemons and reports their lateness, and the multi-host
#: tests share network namespaces and private servers
SERIAL_MARKERS = ("faults", "multihost")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker in SERIAL_MARKERS:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.xdist_group(marker))
                break


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    fault_summary.hand_to_controller(session.config)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    fault_summary.take_from_worker(node)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    fault_summary.report(terminalreporter)
