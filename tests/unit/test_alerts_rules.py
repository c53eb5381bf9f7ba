"""Per-type alerts as a producer sets them (``ax.set_alert``, ``ax alerts``): every bad
input is one clear ValidationError (or a one-line CLI error) and changes nothing; the
secret is a Standard Webhooks key, shown by ``set`` and never by ``list``. On a SQLite file."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select
from standardwebhooks import Webhook

from ax_kombu.alerts import rules
from ax_kombu.api import Client
from ax_kombu.config import from_env
from ax_kombu.exceptions import ValidationError
from ax_kombu.observability.redaction import url_origin
from ax_kombu.store.engine import make_engine
from ax_kombu.store.schema import audit

from ..integration.ax_cli import run_ax

pytestmark = pytest.mark.timeout(60)

HOOK = "https://hooks.example.com/ax"


@pytest.fixture
def client(sqlite_url: str) -> Iterator[Client]:
    c = Client(from_env({}, database_url=sqlite_url))
    yield c
    c.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"task_type": ""}, "task_type must be a non-empty string"),
    ({"task_type": "x" * 129}, "task_type is longer than 128"),
    ({"on": set()}, "on must name at least one of failed, late"),
    ({"on": {"failed", "slow"}}, "on must name at least one of failed, late"),
    ({"on": 3}, "on must be names among failed, late"),
    ({"on": {"late"}, "late_after": None}, "an alert on 'late' needs late_after"),
    ({"on": {"failed"}, "late_after": "30s"}, "late_after applies only to an alert on 'late'"),
    ({"late_after": "soon"}, "late_after 'soon' is not a duration"),
    ({"late_after": "500ms"}, "late_after must be between 1s and 7d"),
    ({"late_after": timedelta(days=8)}, "late_after must be between 1s and 7d"),
    ({"late_after": True}, "late_after must be seconds, a timedelta or a duration"),
    ({"webhook": "ftp://hooks.example.com/x"}, "webhook must be an http:// or https:// URL"),
    ({"webhook": "https:///nohost"}, "webhook must be an http:// or https:// URL"),
    ({"webhook": "http://h:port/x"}, "webhook is not a URL"),
    ({"webhook": None}, "webhook must be a non-empty string"),
    ({"secret": "plain-text"}, "secret must be a Standard Webhooks secret"),
    ({"secret": "whsec_!!!notbase64"}, "the rest is not base64"),
    ({"secret": "whsec_" + base64.b64encode(b"short").decode()}, "secret must hold 24 to 64"),
])
def test_bad_input_is_refused_and_changes_nothing(client: Client, kwargs: dict[str, Any],
                                                  message: str) -> None:
    args: dict[str, Any] = {"task_type": "coupon.grant", "on": {"failed", "late"},
                            "late_after": "30s", "webhook": HOOK, **kwargs}
    with pytest.raises(ValidationError, match=message):
        client.set_alert(args.pop("task_type"), **args)
    assert client.alerts() == []


def test_set_returns_a_standard_secret_list_hides_it_and_a_change_keeps_it(
        client: Client) -> None:
    secret = client.set_alert("coupon.grant", on={"failed", "late"}, late_after="30s",
                              webhook=HOOK)
    assert secret.startswith("whsec_") and len(base64.b64decode(secret[6:])) == 32
    Webhook(secret)  # the receiver's library takes it as it is
    assert client.alerts() == [{"task_type": "coupon.grant", "on": ["failed", "late"],
                                "late_after_ms": 30_000, "webhook": HOOK, "opened_at": None,
                                "events": 0}]
    assert secret not in repr(client.alerts())
    again = client.set_alert("coupon.grant", on="failed", webhook=HOOK + "/2")
    assert again == secret  # receivers keep verifying after a change
    assert client.alerts()[0]["on"] == ["failed"] and client.alerts()[0]["late_after_ms"] is None
    mine = rules.new_secret()
    assert client.set_alert("coupon.grant", on=["late"], late_after=90, webhook=HOOK,
                            secret=mine) == mine
    assert client.set_alert("sms.send", on="failed", webhook=HOOK) != mine  # one per alert
    assert [a["task_type"] for a in client.alerts()] == ["coupon.grant", "sms.send"]
    client.set_alert("sms.send", webhook=HOOK)  # on: failed only, without late_after
    client.set_alert("mail.send", late_after="1m", webhook=HOOK)  # and late with it
    assert {a["task_type"]: a["on"] for a in client.alerts()} == {
        "coupon.grant": ["late"], "mail.send": ["failed", "late"], "sms.send": ["failed"]}
    client.remove_alert("mail.send")
    assert client.remove_alert("coupon.grant") is True
    assert client.remove_alert("coupon.grant") is False
    assert [a["task_type"] for a in client.alerts()] == ["sms.send"]


def test_the_cli_sets_lists_and_removes_and_refuses_in_one_line(sqlite_url: str) -> None:
    env = {"AX_DATABASE_URL": sqlite_url}
    done = run_ax("alerts", "set", "coupon.grant", "--on", "failed,late", "--late-after",
                  "30s", "--webhook", HOOK, env=env)
    assert done.returncode == 0, done.stderr
    secret = done.stdout.split("signing secret (give it to the receiver): ")[1].strip()
    assert secret.startswith("whsec_")
    listed = run_ax("alerts", "list", env=env)
    assert "coupon.grant  on=failed,late late_after=30s" in listed.stdout
    assert "quiet" in listed.stdout and secret not in listed.stdout
    bad = run_ax("alerts", "set", "sms.send", "--on", "late", "--webhook", HOOK, env=env)
    assert bad.returncode != 0
    assert bad.stderr.strip() == ("ax: error: an alert on 'late' needs late_after "
                                  "(e.g. '30s')")
    bad = run_ax("alerts", "set", "sms.send", "--webhook", "nope", env=env)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1
    assert "webhook must be an http:// or https:// URL" in bad.stderr
    assert "sms.send" not in run_ax("alerts", "list", env=env).stdout
    assert run_ax("alerts", "rm", "coupon.grant", env=env).stdout.strip() == \
        "coupon.grant: alert removed"
    assert run_ax("alerts", "list", env=env).stdout.strip() == "(no alerts)"
    engine = make_engine(sqlite_url)
    with engine.connect() as conn:  # each change is in the record of operator actions
        done_rows = list(conn.execute(select(audit.c.action, audit.c.target, audit.c.detail)
                                      .order_by(audit.c.id)))
        assert [tuple(r)[:2] for r in done_rows] == [("alert_set", "type:coupon.grant"),
                                                     ("alert_remove", "type:coupon.grant")]
        # the record names the webhook's host only: its path or query may hold a token
        assert json.loads(done_rows[0].detail)["webhook"] == url_origin(HOOK) != HOOK
    engine.dispose()
