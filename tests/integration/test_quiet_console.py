"""Quiet and resume a worker from the console (issue 40), through Starlette's TestClient
on PostgreSQL: an operator's POST sets and clears the worker's ``quiet_at`` and is in the
audit under their name; a viewer's is refused (403) and changes nothing; the overview
shows the worker's state and the button that fits it; an unknown name is refused."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from starlette.testclient import TestClient

from ax_kombu.api import Client
from ax_kombu.config import Settings
from ax_kombu.store.nodes import Heartbeat, set_quiet

from .console import audit_rows, console, log_in, post

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def settings(web_settings: Settings) -> Settings:
    """``client`` on the console's store (``web_settings``)."""
    return web_settings


@pytest.fixture
def worker(client: Client) -> Heartbeat:
    """A registered worker row, ``w9`` (its beats play the worker's part)."""
    beat = Heartbeat(client.store, "w9", "worker", silence_ms=60_000)
    beat.register({"queues": ["slow"], "quiet": False})
    return beat


def _quiet_at(client: Client) -> int | None:
    with client.store.engine.connect() as conn:
        return conn.execute(text("SELECT quiet_at FROM ax_node WHERE node_id = 'w9'")).scalar()


def _web(settings: Settings, env: dict[str, str], name: str) -> TestClient:
    web = console(settings, env)
    log_in(web, name)
    return web


def test_a_viewer_may_not_quiet_a_worker(web_settings: Settings, users_env: dict[str, str],
                                         client: Client, worker: Heartbeat) -> None:
    with _web(web_settings, users_env, "vera") as web:
        page = web.get("/").text
        assert "w9" in page and 'action="/workers/w9/quiet"' not in page
        refused = post(web, "/workers/w9/quiet")
    assert refused.status_code == 403
    assert _quiet_at(client) is None and audit_rows(client) == []


def test_an_operator_quiets_and_resumes_a_worker(web_settings: Settings,
                                                 users_env: dict[str, str], client: Client,
                                                 worker: Heartbeat) -> None:
    with _web(web_settings, users_env, "otto") as web:
        assert 'action="/workers/w9/quiet"' in web.get("/").text
        done = post(web, "/workers/w9/quiet")
        assert done.status_code == 303 and _quiet_at(client) is not None
        assert 'class="quieting"' in web.get("/overview/live").text
        assert worker.beat({"queues": ["slow"], "quiet": True}) and worker.quiet_at is not None
        page = web.get("/").text
        assert 'class="quiet"' in page and 'action="/workers/w9/resume"' in page
        assert post(web, "/workers/w9/resume").status_code == 303
        assert _quiet_at(client) is None
        assert worker.beat({"queues": ["slow"], "quiet": False}) and worker.quiet_at is None
        unknown = post(web, "/workers/nobody/quiet")
    assert unknown.status_code == 400 and "no live worker named" in unknown.text
    assert [(a, v, act, t) for a, v, act, t in audit_rows(client)] == [
        ("otto", "web", "worker_quiet", "worker:w9"), ("otto", "web", "worker_resume", "worker:w9")]


def test_a_supervisor_name_quiets_its_children(client: Client) -> None:
    """``sup`` has no row: its children ``sup.N`` are asked (not ``super.1``)."""
    for name in ("sup.1", "sup.2", "super.1"):
        Heartbeat(client.store, name, "worker", silence_ms=60_000).register({})
    with client.store.engine.begin() as conn:
        assert set_quiet(conn, "sup", True, 60_000) == ["sup.1", "sup.2"]
