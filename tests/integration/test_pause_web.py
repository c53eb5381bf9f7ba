"""The console's ``/pauses`` page through Starlette's TestClient on PostgreSQL: a viewer
sees the pauses but no buttons, and a pause or resume they POST is refused with 403 and
changes nothing; an operator pauses a type and a queue and resumes them, each change in
``/audit`` under their name; a bad name is refused and changes nothing."""

from __future__ import annotations

import pytest

from ax_kombu.api import Client
from ax_kombu.config import Settings

from .console import audit_rows, console, log_in, post

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def settings(web_settings: Settings) -> Settings:
    """``client`` on the console's store (``web_settings``)."""
    return web_settings


def paused(client: Client) -> list[tuple[str, str, str]]:
    return [(p.kind, p.name, p.actor) for p in client.pauses()]


def test_a_viewer_sees_pauses_and_cannot_change_them(
        web_settings: Settings, users_env: dict[str, str], client: Client) -> None:
    client.pause_type("sms.send", actor="ops")
    before = audit_rows(client)
    with console(web_settings, users_env) as web:
        log_in(web, "vera")
        page = web.get("/pauses")
        assert page.status_code == 200
        assert "sms.send" in page.text and 'href="/pauses"' in page.text
        assert "/pauses/resume" not in page.text and "/pauses/pause" not in page.text
        for path, fields in (("/pauses/resume", {"kind": "type", "name": "sms.send"}),
                             ("/pauses/pause", {"kind": "type", "name": "other"}),
                             ("/pauses/pause", {"kind": "queue", "name": "slow"})):
            assert post(web, path, **fields).status_code == 403, path
    assert paused(client) == [("type", "sms.send", "ops")]
    assert audit_rows(client) == before


def test_an_operator_pauses_and_resumes_in_the_audit_under_their_name(
        web_settings: Settings, users_env: dict[str, str], client: Client) -> None:
    slow = web_settings.queue_for("slow")
    with console(web_settings, users_env) as web:
        log_in(web, "otto")
        assert "/pauses/pause" in web.get("/pauses").text
        done = post(web, "/pauses/pause", kind="type", name="sms.send")
        assert done.status_code == 303 and done.headers["location"] == "/pauses?note=paused"
        assert post(web, "/pauses/pause", kind="queue", name=slow).status_code == 303
        assert paused(client) == [("type", "sms.send", "otto"), ("queue", slow, "otto")]
        page = web.get("/pauses").text
        assert "sms.send" in page and "/pauses/resume" in page
        assert post(web, "/pauses/resume", kind="type", name="sms.send").status_code == 303
        assert post(web, "/pauses/resume", kind="queue", name=slow).status_code == 303
        refused = post(web, "/pauses/pause", kind="queue", name="no-such-queue")
        assert refused.status_code == 400 and "unknown queue" in refused.text
        assert post(web, "/pauses/pause", kind="worker", name="x").status_code == 400
    assert paused(client) == []
    assert [r for r in audit_rows(client) if r[2].startswith(("pause", "resume"))] == [
        ("otto", "web", "pause_type", "type:sms.send"),
        ("otto", "web", "pause_queue", f"queue:{slow}"),
        ("otto", "web", "resume_type", "type:sms.send"),
        ("otto", "web", "resume_queue", f"queue:{slow}")]
