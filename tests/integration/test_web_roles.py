"""Console users and roles through Starlette's TestClient on PostgreSQL: users from an
``AX_WEB_USERS`` file logging in with their password, a trusted proxy header with a
role map, the token as admin; a POST beyond the caller's role refused with 403 and
changing nothing; each action recorded in ``/audit`` under the caller's name."""

from __future__ import annotations

import pytest

from ax_kombu.api import Client
from ax_kombu.config import Settings

from .console import audit_rows, console, csrf, log_in, post
from .test_admin_cli import make, row

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TOKEN = "roles-token"


@pytest.fixture
def settings(web_settings: Settings) -> Settings:
    """``client`` on the console's store (``web_settings``)."""
    return web_settings


def test_a_viewer_reads_but_every_post_is_refused_and_changes_nothing(
        web_settings: Settings, users_env: dict[str, str], client: Client) -> None:
    waiting = make(client, "t", "DELAYED")
    failed = make(client, "t", "FAILED", last_error="boom")
    client.schedule("nightly", "t", every=60)
    with console(web_settings, users_env) as web:
        log_in(web, "vera")
        page = web.get(f"/tasks/{waiting}").text
        assert 'id="me"' in page and "vera" in page and "(viewer)" in page
        assert "/cancel" not in page and "/run-now" not in page  # no buttons for a viewer
        assert "/jobs/nightly/pause" not in web.get("/jobs").text
        assert "/limits/set" not in web.get("/limits").text
        for path, fields in ((f"/tasks/{waiting}/cancel", {}), (f"/tasks/{failed}/retry", {}),
                             (f"/tasks/{waiting}/run-now", {}),
                             (f"/tasks/{waiting}/postpone", {"delay": "10m"}),
                             ("/jobs/nightly/pause", {}), ("/jobs/nightly/run", {}),
                             ("/limits/set", {"task_type": "t", "max_running": "3"})):
            answer = post(web, path, **fields)
            assert answer.status_code == 403, path
            assert "vera may not do this" in answer.text
        assert web.get("/audit").status_code == 200
    assert row(client, waiting).status == "DELAYED" and row(client, failed).status == "FAILED"
    assert not client.job("nightly").paused and client.limits() == {}
    assert [t.task_id for t in client.occurrences("nightly")] == []
    assert audit_rows(client) == []


def test_an_operators_cancel_shows_in_audit_but_limits_need_an_admin(
        web_settings: Settings, users_env: dict[str, str], client: Client) -> None:
    waiting = make(client, "t", "DELAYED")
    with console(web_settings, users_env) as web:
        log_in(web, "otto")
        assert f'action="/tasks/{waiting}/cancel"' in web.get(f"/tasks/{waiting}").text
        assert post(web, f"/tasks/{waiting}/cancel").status_code == 303
        assert post(web, "/limits/set", task_type="t", max_running="3").status_code == 403
        page = web.get("/audit").text
        assert f'data-actor="otto" data-target="task:{waiting}"' in page
        assert 'href="/audit"' in page
    assert row(client, waiting).status == "CANCELLED" and client.limits() == {}
    assert audit_rows(client) == [("otto", "web", "cancel", f"task:{waiting}")]
    with console(web_settings, users_env) as web:
        log_in(web, "ada")
        assert post(web, "/limits/set", task_type="t", max_running="3").status_code == 303
    assert client.limits() == {"t": 3}
    assert audit_rows(client)[-1] == ("ada", "web", "limit_set", "type:t")


def test_a_wrong_password_logs_nobody_in_and_logout_ends_the_session(
        web_settings: Settings, users_env: dict[str, str]) -> None:
    with console(web_settings, users_env) as web:
        form = web.get("/login").text
        assert 'name="user"' in form and 'name="token"' not in form
        wrong = web.post("/login", data={"csrf": csrf(form), "user": "ada",
                                         "password": "otto-pw", "next": "/"})
        assert wrong.status_code == 401 and "ax_session" not in wrong.cookies
        log_in(web, "ada")
        cookie = web.cookies["ax_session"]
        assert web.get("/").status_code == 200
        web.post("/logout", data={"csrf": csrf(web.get("/").text)})
        web.cookies.set("ax_session", cookie)  # the old session id, replayed
        assert web.get("/").status_code == 303


def test_the_trusted_header_maps_names_to_roles(web_settings: Settings,
                                                client: Client) -> None:
    env = {"AX_WEB_TRUSTED_HEADER": "X-Forwarded-User",
           "AX_WEB_ROLE_MAP": "bob=operator,*=viewer"}
    waiting = make(client, "t", "DELAYED")
    with console(web_settings, env) as web:
        assert web.get("/").status_code == 303  # no header: to the login form
        eve = {"X-Forwarded-User": "eve"}
        form = web.get(f"/tasks/{waiting}", headers=eve).text
        refused = web.post(f"/tasks/{waiting}/cancel", data={"csrf": csrf(form)}, headers=eve)
        assert refused.status_code == 403
        bob = {"X-Forwarded-User": "bob"}
        done = web.post(f"/tasks/{waiting}/cancel", data={"csrf": csrf(form)}, headers=bob)
        assert done.status_code == 303
    assert row(client, waiting).status == "CANCELLED"
    assert audit_rows(client) == [("bob", "web", "cancel", f"task:{waiting}")]


def test_the_token_acts_as_admin_named_token(web_settings: Settings, client: Client) -> None:
    waiting = make(client, "t", "DELAYED")
    with console(web_settings, {}, TOKEN) as web:
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        form = web.get("/limits", headers=bearer).text
        assert web.post("/limits/set", data={"csrf": csrf(form), "task_type": "t",
                                             "max_running": "2"}, headers=bearer).status_code == 303
        assert web.post(f"/tasks/{waiting}/cancel", data={"csrf": csrf(form)},
                        headers=bearer).status_code == 303
    assert audit_rows(client) == [("token", "web", "limit_set", "type:t"),
                                  ("token", "web", "cancel", f"task:{waiting}")]
