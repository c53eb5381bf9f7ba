"""libpq's multi-host database URL (issue 24): ``postgresql://user@h1:p1,h2:p2/db`` is
accepted and reaches psycopg2 as the host and port lists libpq tries in turn."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.dialects.postgresql import psycopg2

from ax_kombu.exceptions import ConfigurationError
from ax_kombu.store.engine import check_database_url, parse_database_url


def connect_args(url: str) -> dict[str, object]:
    """What SQLAlchemy's psycopg2 dialect hands ``psycopg2.connect`` for ``url``."""
    dialect: Any = psycopg2.dialect  # untyped in SQLAlchemy
    _, kwargs = dialect().create_connect_args(parse_database_url(url))
    return dict(kwargs)


def test_hosts_with_ports_become_libpq_lists() -> None:
    args = connect_args("postgresql://ax:secret@10.0.0.1:5433,10.0.0.2:5434/app"
                        "?target_session_attrs=read-write")
    assert args == {"host": "10.0.0.1,10.0.0.2", "port": "5433,5434", "dbname": "app",
                    "user": "ax", "password": "secret", "target_session_attrs": "read-write"}


def test_the_issue_form_without_ports() -> None:
    args = connect_args("postgresql://ax@h1,h2/db?target_session_attrs=read-write")
    assert args["host"] == "h1,h2"
    assert args["port"] in (None, ",")  # an empty element: libpq's default port
    assert args["target_session_attrs"] == "read-write"


def test_a_port_on_some_hosts_only_and_ipv6() -> None:
    args = connect_args("postgres://[::1]:6000,db.internal/app")
    assert (args["host"], args["port"]) == ("::1,db.internal", "6000,")


def test_sqlalchemy_query_form_is_unchanged() -> None:
    args = connect_args("postgresql://ax@/app?host=h1:5433&host=h2:5434")
    assert (args["host"], args["port"]) == ("h1,h2", "5433,5434")


def test_a_single_host_is_unchanged() -> None:
    url = parse_database_url("postgresql://ax:pw@h1:5433/app?sslmode=require")
    assert (url.host, url.port, url.database, url.drivername) == (
        "h1", 5433, "app", "postgresql+psycopg2")


def test_the_password_is_kept_and_the_driver_checked() -> None:
    check_database_url("postgresql://ax:p%40ss@h1:5433,h2:5434/app")
    assert connect_args("postgresql://ax:p%40ss@h1:5433,h2:5434/app")["password"] == "p@ss"


@pytest.mark.parametrize("url", [
    "postgresql://ax@h1:x,h2/app",       # port not a number
    "postgresql://ax@h1,,h2/app",        # empty host
    "postgresql://ax@[::1]x,h2/app",     # junk after a bracketed address
    "postgresql://ax@h1,h2/app?port=5",  # hosts given twice
    "postgresql://ax@h1,h2/app?host=h3",
])
def test_malformed_host_lists_are_refused(url: str) -> None:
    with pytest.raises(ConfigurationError):
        parse_database_url(url)


def test_each_url_of_a_failover_list_is_tried_once_without_a_pause() -> None:
    """ensure_connected walks a failover list to its end (Kombu sleeps only after a full
    cycle); one URL keeps the single retry it always had."""
    from kombu import Connection

    from ax_kombu.broker.connection import ensure_connected

    tried: list[int] = []

    class Refusing(Connection):  # type: ignore[misc]
        def _connection_factory(self) -> None:
            tried.append(self.port)
            raise ConnectionRefusedError("refused")

    three = Refusing("amqp://127.0.0.1:1//;amqp://127.0.0.1:2//;amqp://127.0.0.1:3//")
    with pytest.raises(Exception):  # noqa: B017 - Kombu's OperationalError
        ensure_connected(three)
    assert tried == [1, 2, 3]
