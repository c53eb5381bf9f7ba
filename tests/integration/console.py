"""The console (``ax web``) as the integration tests drive it: Starlette's TestClient on
an app of the test's settings, logging in as one of the users of :data:`PASSWORDS` (the
``users_env`` fixture of ``conftest.py`` writes them to an ``AX_WEB_USERS`` file), posting
a form with the CSRF token a page holds, and reading back the audit record.

The fixtures the console tests share (``web_settings``: this run's PostgreSQL database and
a SQLite broker; ``users_env``) are in ``conftest.py``."""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import select
from starlette.testclient import TestClient

from ax_kombu.api import Client
from ax_kombu.config import Settings
from ax_kombu.store.schema import audit
from ax_kombu.web.access import Access
from ax_kombu.web.app import create_app

BASE = "http://127.0.0.1"
#: the console users of ``users_env``: name to (role, password)
PASSWORDS = {"vera": ("viewer", "vera-pw"), "otto": ("operator", "otto-pw"),
             "ada": ("admin", "ada-pw")}


def csrf(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found, "the page holds no CSRF token"
    return found.group(1)


def console(settings: Settings, env: dict[str, str], token: str | None = None) -> TestClient:
    """The console's app with the access ``env`` (``AX_WEB_*``) and ``token`` configure."""
    app = create_app(settings, access=Access.configure(token, env))
    return TestClient(app, base_url=BASE, follow_redirects=False)


def log_in(web: TestClient, name: str) -> None:
    form = web.get("/login")
    done = web.post("/login", data={"csrf": csrf(form.text), "user": name,
                                    "password": PASSWORDS[name][1], "next": "/"})
    assert done.status_code == 303, done.text


def post(web: TestClient, path: str, **fields: Any) -> Any:
    """POST a form with the CSRF token of the ``/audit`` page (every role may read it)."""
    return web.post(path, data={"csrf": csrf(web.get("/audit").text), **fields})


def audit_rows(client: Client) -> list[tuple[str, str, str, str]]:
    """Every audit row as ``(actor, via, action, target)``, oldest first."""
    with client.store.engine.connect() as conn:
        return [(r.actor, r.via, r.action, r.target)
                for r in conn.execute(select(audit).order_by(audit.c.id))]
