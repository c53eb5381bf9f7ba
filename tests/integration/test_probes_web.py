"""``ax web``'s probes through Starlette's TestClient on this run's PostgreSQL database:
open without a login, /readyz 503 with its reason while the database is cut off (through
a TCP proxy), and 200 again once it is back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from ax_kombu.config import from_env
from ax_kombu.web.app import create_app

from ..faults.proxy import TcpProxy
from ..waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    made = TcpProxy()
    yield made
    made.close()


@pytest.fixture
def console(pg_url: str, proxy: TcpProxy, tmp_path: Path) -> Iterator[TestClient]:
    """The console with a token (every page needs a login), its database through ``proxy``."""
    settings = from_env({}, database_url=proxy.url(pg_url),
                        broker_url=f"ax+sqlite:///{tmp_path / 'broker.sqlite3'}")
    with TestClient(create_app(settings, "s3cret-token"), base_url="http://127.0.0.1",
                    follow_redirects=False) as browser:
        yield browser


def test_the_probes_need_no_login_where_a_page_does(console: TestClient) -> None:
    assert console.get("/").status_code == 303  # to the login form
    for path in ("/healthz", "/readyz"):
        answer = console.get(path)
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"] == "application/json"
        assert answer.json()["ok"] is True
        assert console.head(path).status_code == 200
    assert console.get("/readyz").json()["reason"] == "database reachable"


def test_readyz_is_503_while_the_database_is_cut_off(console: TestClient,
                                                     proxy: TcpProxy) -> None:
    assert console.get("/readyz").status_code == 200
    proxy.cut(60)
    answer = console.get("/readyz")
    assert answer.status_code == 503, answer.text
    assert answer.json()["check"] == "database"
    assert answer.json()["reason"].startswith("database unreachable: ")
    assert console.get("/healthz").status_code == 200  # serving all the same
    proxy.cut(0)  # back
    eventually(lambda: console.get("/readyz").status_code == 200, 10, "ready again")
