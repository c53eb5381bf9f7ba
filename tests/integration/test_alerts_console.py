"""Per-type alerts in the console (issue 40), through Starlette's TestClient on PostgreSQL:
every role reads ``/alerts`` (the webhook as ``scheme://host/…`` only, the incident
state); a viewer's POST is refused (403) and changes nothing; an admin sets an alert (the
signing secret shown once), changes and removes it, each in the audit under their name;
bad input shows the API's own message and writes nothing."""

from __future__ import annotations

import html
import json

import pytest
from sqlalchemy import select, update
from starlette.testclient import TestClient

from ax_kombu.api import Client
from ax_kombu.config import Settings
from ax_kombu.exceptions import ValidationError
from ax_kombu.store.schema import alerts, audit

from .console import audit_rows, console, csrf, log_in, post

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

#: a webhook whose path and query carry the receiver's tokens
HOOK = "https://hooks.example.com/services/T0/B0/path-token?key=query-token"


@pytest.fixture
def settings(web_settings: Settings) -> Settings:
    """``client`` on the console's store (``web_settings``)."""
    return web_settings


def _stored(client: Client) -> dict[str, dict[str, object]]:
    with client.store.engine.connect() as conn:
        return {r.task_type: dict(r._mapping) for r in conn.execute(select(alerts))}


def _details(client: Client) -> list[dict[str, object] | None]:
    with client.store.engine.connect() as conn:
        return [None if d is None else json.loads(d)
                for d in conn.execute(select(audit.c.detail).order_by(audit.c.id)).scalars()]


def test_a_viewer_reads_the_alerts_but_may_not_change_them(
        web_settings: Settings, users_env: dict[str, str], client: Client) -> None:
    secret = client.set_alert("coupon.grant", on={"failed", "late"}, late_after="30s",
                              webhook=HOOK)
    client.set_alert("sms.send", webhook="http://10.0.0.7:8080/")
    with client.store.engine.begin() as conn:  # an open incident, as the evaluator leaves it
        conn.execute(update(alerts).where(alerts.c.task_type == "coupon.grant").values(
            opened_at=1_780_000_000_000, last_event_at=1_780_000_060_000, events=7))
    before = _stored(client)
    with console(web_settings, users_env) as web:
        log_in(web, "vera")
        page = web.get("/alerts").text
        assert 'href="/alerts"' in web.get("/").text
        refused = [post(web, "/alerts/set", task_type="coupon.grant", on="failed",
                        webhook="https://evil.example.com/"),
                   post(web, "/alerts/remove", task_type="coupon.grant")]
    coupon = page.split('data-type="coupon.grant"')[1].split("</tr>")[0]
    assert 'data-incident="open"' in coupon and "30s" in coupon and "failed, late" in coupon
    assert "https://hooks.example.com/…" in coupon and ">7<" in coupon
    assert "2026-05-28 20:26:40.000" in coupon and "2026-05-28 20:27:40.000" in coupon
    sms = page.split('data-type="sms.send"')[1].split("</tr>")[0]
    assert 'data-incident="resolved"' in sms and "http://10.0.0.7:8080/<" in sms
    assert "path-token" not in page and "query-token" not in page
    assert secret not in page and "whsec_" not in page
    assert 'action="/alerts/set"' not in page and 'action="/alerts/remove"' not in page
    assert [r.status_code for r in refused] == [403, 403]
    assert "vera may not do this" in refused[0].text
    assert _stored(client) == before and audit_rows(client) == []


def test_an_admin_sets_changes_and_removes_an_alert(
        web_settings: Settings, users_env: dict[str, str], client: Client) -> None:
    with console(web_settings, users_env) as web:
        log_in(web, "ada")
        assert 'action="/alerts/set"' in web.get("/alerts").text
        made = web.post("/alerts/set", data={
            "csrf": _csrf(web), "task_type": "coupon.grant", "on": ["failed", "late"],
            "late_after": "30s", "webhook": HOOK})
        key = str(_stored(client)["coupon.grant"]["secret"])
        assert made.status_code == 200 and made.headers["cache-control"] == "no-store"
        assert key.startswith("whsec_") and f'id="alert-secret">{key}<' in made.text
        assert "path-token" not in made.text and "query-token" not in made.text
        assert key not in web.get("/alerts").text  # shown once

        changed = web.post("/alerts/set", data={
            "csrf": _csrf(web), "task_type": "coupon.grant", "on": "failed",
            "webhook": "https://other.example.com/ax"})
        assert changed.status_code == 200 and key in changed.text  # kept, as the API keeps it
        row = _stored(client)["coupon.grant"]
        assert (row["on_failed"], row["on_late"], row["late_after_ms"], row["webhook"],
                row["secret"]) == (True, False, None, "https://other.example.com/ax", key)
        form = web.get("/alerts?edit=coupon.grant").text
        assert 'name="task_type" value="coupon.grant"' in form and "Change the alert" in form

        removed = web.post("/alerts/remove", data={"csrf": _csrf(web),
                                                   "task_type": "coupon.grant"})
        assert removed.status_code == 303
        assert "Alert removed." in web.get(removed.headers["location"]).text
        again = web.post("/alerts/remove", data={"csrf": _csrf(web),
                                                 "task_type": "coupon.grant"})
        assert "There was no such alert." in web.get(again.headers["location"]).text
    assert _stored(client) == {} and client.alerts() == []
    assert audit_rows(client) == [("ada", "web", "alert_set", "type:coupon.grant"),
                                  ("ada", "web", "alert_set", "type:coupon.grant"),
                                  ("ada", "web", "alert_remove", "type:coupon.grant")]
    assert _details(client)[:2] == [
        {"on": ["failed", "late"], "late_after_ms": 30000,
         "webhook": "https://hooks.example.com/…"},
        {"on": ["failed"], "late_after_ms": None, "webhook": "https://other.example.com/…"}]


@pytest.mark.parametrize("fields", [
    {"webhook": "ftp://hooks.example.com/ax", "on": "failed"},
    {"webhook": "https://hooks.example.com/ax", "on": "late"},
    {"webhook": "https://hooks.example.com/ax", "on": "failed", "late_after": "soon"},
], ids=["not-http", "late-without-late-after", "bad-duration"])
def test_bad_input_shows_the_apis_message_and_writes_nothing(
        web_settings: Settings, users_env: dict[str, str], client: Client,
        fields: dict[str, str]) -> None:
    with pytest.raises(ValidationError) as expected:
        client.set_alert("coupon.grant", on=[fields["on"]],
                         late_after=fields.get("late_after"), webhook=fields["webhook"])
    with console(web_settings, users_env) as web:
        log_in(web, "ada")
        answer = post(web, "/alerts/set", task_type="coupon.grant", **fields)
    assert answer.status_code == 400
    shown = answer.text.split('class="error" role="alert">')[1].split("</p>")[0]
    assert html.unescape(shown) == str(expected.value)
    assert f'value="{fields["webhook"]}"' in answer.text  # the form comes back as typed
    assert 'id="alert-secret"' not in answer.text
    assert _stored(client) == {} and audit_rows(client) == []


def _csrf(web: TestClient) -> str:
    return csrf(web.get("/alerts").text)
