"""``ax web`` through Starlette's TestClient against this run's PostgreSQL database: the
token gate, CSRF, escaping, keyset pages, and each action changing the rows it should
(and a forged one changing none)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select
from starlette.testclient import TestClient

from ax_kombu.api import Client
from ax_kombu.config import Settings
from ax_kombu.store.schema import jobs, limits, tasks
from ax_kombu.web.app import create_app

from .ax_cli import run_ax
from .console import BASE, csrf
from .test_admin_cli import add_attempt, make, row

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TOKEN = "s3cret-token"


@pytest.fixture
def settings(web_settings: Settings) -> Settings:
    """``client`` on the console's store (``web_settings``)."""
    return web_settings


def _browser(settings: Settings, token: str | None) -> Iterator[TestClient]:
    with TestClient(create_app(settings, token), base_url=BASE,
                    follow_redirects=False) as browser:
        yield browser


@pytest.fixture
def web(web_settings: Settings) -> Iterator[TestClient]:
    """The console without a token (loopback only)."""
    yield from _browser(web_settings, None)


@pytest.fixture
def guarded(web_settings: Settings) -> Iterator[TestClient]:
    """The console with AX_WEB_TOKEN set."""
    yield from _browser(web_settings, TOKEN)


def post(web: TestClient, path: str, **fields: Any) -> Any:
    """POST a form as the page would: with the CSRF token a page holds."""
    token = csrf(web.get("/limits").text)
    return web.post(path, data={"csrf": token, **fields})


def test_without_token_pages_redirect_to_login_and_the_token_lets_in(guarded: TestClient) -> None:
    for path in ("/", "/tasks?status=FAILED", "/jobs", "/limits", "/overview/live"):
        answer = guarded.get(path)
        assert answer.status_code == 303, path
        assert answer.headers["location"].startswith("/login?next=")
    login = guarded.get("/login")
    assert login.status_code == 200
    wrong = guarded.post("/login", data={"csrf": csrf(login.text), "token": "nope",
                                         "next": "/jobs"})
    assert wrong.status_code == 401 and "ax_session" not in wrong.cookies
    right = guarded.post("/login", data={"csrf": csrf(login.text), "token": TOKEN,
                                         "next": "/jobs"})
    assert right.status_code == 303 and right.headers["location"] == "/jobs"
    cookie = right.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and TOKEN not in cookie
    assert guarded.get("/jobs").status_code == 200  # the client keeps the cookie


def test_bearer_token_is_accepted_and_a_wrong_one_is_not(guarded: TestClient) -> None:
    assert guarded.get("/", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert guarded.get("/", headers={"Authorization": "Bearer wrong"}).status_code == 303


def test_post_without_login_is_refused_and_changes_nothing(guarded: TestClient,
                                                           client: Client) -> None:
    task_id = make(client, "t", "FAILED", last_error="boom")
    answer = guarded.post(f"/tasks/{task_id}/retry", data={"csrf": "x"})
    assert answer.status_code == 403
    assert row(client, task_id).status == "FAILED"


def test_forged_post_is_refused_and_changes_nothing(web: TestClient, client: Client) -> None:
    failed = make(client, "t", "FAILED", last_error="boom")
    waiting = make(client, "t", "DELAYED")
    client.schedule("nightly", "t", every=60)
    for path, fields in ((f"/tasks/{failed}/retry", {}), (f"/tasks/{waiting}/cancel", {}),
                         ("/jobs/nightly/pause", {}), ("/jobs/nightly/run", {}),
                         ("/limits/set", {"task_type": "t", "max_running": "3"})):
        for forged in ({}, {"csrf": "0" * 64}):
            answer = web.post(path, data={**forged, **fields})
            assert answer.status_code == 403, path
            assert "CSRF" in answer.text
    assert row(client, failed).status == "FAILED"
    assert row(client, waiting).status == "DELAYED"
    assert not client.job("nightly").paused
    assert client.limits() == {}
    assert [t.task_id for t in client.occurrences("nightly")] == []


def test_script_in_task_type_payload_and_error_renders_as_text(web: TestClient,
                                                               client: Client) -> None:
    evil = "<script>alert(1)</script>"
    task_id = make(client, evil, "FAILED", last_error=evil)
    with client.store.engine.begin() as conn:
        conn.execute(tasks.update().where(tasks.c.task_id == task_id)
                     .values(payload=f'{{"x": "{evil}"}}'))
    for path in (f"/tasks/{task_id}", f"/tasks?type={evil}", "/tasks"):
        page = web.get(path)
        assert page.status_code == 200
        assert evil not in page.text, path
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text, path
    bad = web.get(f"/tasks?status={evil}")
    assert bad.status_code == 400 and evil not in bad.text


def test_callback_url_secrets_are_redacted(web: TestClient, client: Client) -> None:
    task_id = int(client.enqueue("hook", {}, delay=3600,
                                 callback_url="https://user:pw@example.com/cb?token=abc"))
    page = web.get(f"/tasks/{task_id}").text
    assert "pw@" not in page and "token=abc" not in page
    assert "token=***" in page


def test_keyset_pages_cover_every_task_once_newest_first(web: TestClient,
                                                        client: Client) -> None:
    made = [make(client, "paged") for _ in range(120)]
    seen: list[int] = []
    path = "/tasks?type=paged"
    while path:
        page = web.get(path)
        assert page.status_code == 200
        seen += [int(i) for i in re.findall(r'<a href="/tasks/(\d+)">', page.text)]
        older = re.search(r'<a href="(/tasks\?[^"]+)" rel="next">', page.text)
        path = older.group(1).replace("&amp;", "&") if older else ""
        assert "offset" not in path.lower()
    assert seen == sorted(made, reverse=True)


def test_search_by_biz_key_status_and_time_range(web: TestClient, client: Client) -> None:
    wanted = make(client, "t", "FAILED", biz_key="order-42")
    other = make(client, "t", "FAILED")
    found = web.get("/tasks?biz_key=order-42").text
    assert f"/tasks/{wanted}" in found and f"/tasks/{other}" not in found
    failed = web.get("/tasks?status=failed").text
    assert f"/tasks/{wanted}" in failed and f"/tasks/{other}" in failed
    assert f"/tasks/{other}" not in web.get("/tasks?to=2024-06-01T00:00").text
    assert f"/tasks/{other}" in web.get("/tasks?from=2024-06-01T00:00").text
    assert web.get("/tasks?id=notanumber").status_code == 400


def test_cancel_and_retry_change_the_rows(web: TestClient, client: Client) -> None:
    waiting = make(client, "t", "DELAYED")
    failed = make(client, "t", "FAILED", last_error="boom", attempt=1)
    assert post(web, f"/tasks/{waiting}/cancel").status_code == 303
    assert row(client, waiting).status == "CANCELLED"
    assert post(web, f"/tasks/{failed}/retry").headers["location"] == \
        f"/tasks/{failed}?note=retried"
    assert row(client, failed).status == "READY"
    again = post(web, f"/tasks/{failed}/retry")  # READY now: refused, with the reason
    assert again.status_code == 409 and "READY" in again.text
    assert post(web, "/tasks/123/cancel").status_code == 404


def test_task_page_shows_attempts_error_and_trace_id(web: TestClient, client: Client) -> None:
    task_id = make(client, "t", "FAILED", last_error="ValueError: boom", attempt=1,
                   owner_node="worker-a", started_at=1, dispatched_at=1)
    view = client.get(task_id)
    page = web.get(f"/tasks/{task_id}").text
    assert view.trace_id in page and "ValueError: boom" in page and "worker-a" in page
    assert 'class="attempt outcome-FAILED"' in page
    assert f'action="/tasks/{task_id}/retry"' in page


def test_pause_resume_and_run_now(web: TestClient, client: Client) -> None:
    client.schedule("nightly", "t", every=3600, processor="p")
    page = web.get("/jobs").text
    assert "nightly" in page and page.count("<li>") >= 5  # the next 5 fire times
    assert post(web, "/jobs/nightly/pause").status_code == 303
    assert client.job("nightly").paused
    assert post(web, "/jobs/nightly/resume").status_code == 303
    assert not client.job("nightly").paused
    assert post(web, "/jobs/nightly/run").status_code == 303
    made = client.occurrences("nightly")
    assert len(made) == 1 and made[0].job == "nightly"
    assert f"/tasks/{made[0].task_id}" in web.get("/jobs").text  # the last occurrence
    assert post(web, "/jobs/nope/pause").status_code == 404
    with client.store.engine.connect() as conn:
        assert conn.execute(select(jobs.c.name)).scalars().all() == ["nightly"]


def test_limit_set_and_clear(web: TestClient, client: Client) -> None:
    make(client, "capped", "RUNNING")
    assert post(web, "/limits/set", task_type="capped", max_running="2").status_code == 303
    assert client.limits() == {"capped": 2}
    page = web.get("/limits").text
    assert re.search(r"<td>capped</td><td>2</td><td>1</td>", page)  # limit 2, 1 running
    assert post(web, "/limits/set", task_type="capped", max_running="0").status_code == 400
    assert post(web, "/limits/clear", task_type="capped").status_code == 303
    with client.store.engine.connect() as conn:
        assert conn.execute(select(limits)).all() == []


def test_overview_shows_nodes_counts_and_charts(web: TestClient, client: Client) -> None:
    make(client, "t", "FAILED")
    page = web.get("/").text
    assert 'id="live"' in page and "<svg" in page and "FAILED" in page
    live = web.get("/overview/live")
    assert live.status_code == 200 and "<html" not in live.text and "Oldest overdue" in live.text
    assert "Content-Security-Policy" in live.headers


def test_a_foreign_host_name_is_refused_without_token(web: TestClient) -> None:
    """A page that rebinds its DNS name to 127.0.0.1 cannot read the console."""
    assert web.get("/", headers={"Host": "evil.example"}).status_code == 400


def test_refuses_to_bind_a_public_address_without_token(pg_url: str) -> None:
    done = run_ax("web", "--bind", "0.0.0.0", "--port", "0", env={"AX_DATABASE_URL": pg_url})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "AX_WEB_TOKEN" in lines[0] and lines[0].startswith("ax: error:")


def test_run_now_and_postpone_change_the_row_and_list_the_moves(web: TestClient,
                                                                client: Client) -> None:
    waiting = make(client, "t", "DELAYED")
    page = web.get(f"/tasks/{waiting}").text
    assert f'action="/tasks/{waiting}/run-now"' in page
    assert f'action="/tasks/{waiting}/postpone"' in page
    for path in (f"/tasks/{waiting}/run-now", f"/tasks/{waiting}/postpone"):
        assert web.post(path, data={"csrf": "0" * 64, "delay": "1m"}).status_code == 403
    assert row(client, waiting).status == "DELAYED" and client.get(waiting).moves == ()

    moved = post(web, f"/tasks/{waiting}/run-now")
    assert moved.headers["location"] == f"/tasks/{waiting}?note=run-now"
    assert row(client, waiting).status == "READY"
    assert row(client, waiting).trigger_time <= client.store.now_ms()

    before = client.store.now_ms()
    assert post(web, f"/tasks/{waiting}/postpone", delay="10m").status_code == 303
    later = row(client, waiting)
    assert later.status == "DELAYED"
    assert before + 600_000 <= later.trigger_time <= client.store.now_ms() + 600_000
    assert post(web, f"/tasks/{waiting}/postpone", at="2030-01-01T00:00:00").status_code == 303
    assert row(client, waiting).trigger_time == 1_893_456_000_000  # read as UTC

    for bad in ({"delay": "soon"}, {}, {"delay": "1m", "at": "2030-01-01T00:00"}):
        refused = post(web, f"/tasks/{waiting}/postpone", **bad)
        assert refused.status_code == 400 and 'id="refused"' in refused.text, bad
    assert row(client, waiting).trigger_time == 1_893_456_000_000

    page = web.get(f"/tasks/{waiting}?note=rescheduled").text
    assert "Rescheduled." in page
    kinds = re.findall(r'<tr class="move kind-(\w+)">', page)
    assert kinds == ["run_now", "reschedule", "reschedule"]
    assert "2030-01-01 00:00:00.000" in page


def test_postpone_of_a_claimed_task_shows_the_refusal_and_changes_nothing(
        web: TestClient, client: Client) -> None:
    claimed = make(client, "t", "DISPATCHING", attempt=1,
                   trigger_time=client.store.now_ms() - 1000)
    before = row(client, claimed)
    page = web.get(f"/tasks/{claimed}").text
    assert "/postpone" not in page and "/run-now" not in page  # only Cancel is offered
    assert f'action="/tasks/{claimed}/cancel"' in page
    for path, fields in ((f"/tasks/{claimed}/postpone", {"delay": "10m"}),
                         (f"/tasks/{claimed}/run-now", {})):
        refused = post(web, path, **fields)
        assert refused.status_code == 409, path
        assert 'id="refused"' in refused.text and "already started" in refused.text
        assert 'id="status">DISPATCHING' in refused.text  # the task's own page
    assert row(client, claimed) == before and client.get(claimed).moves == ()

    done = make(client, "t", "SUCCESS")
    refused = post(web, f"/tasks/{done}/run-now")
    assert refused.status_code == 409 and "SUCCESS" in refused.text
    assert post(web, "/tasks/123/run-now").status_code == 404


def test_task_page_shows_each_attempts_outcome_kind(web: TestClient, client: Client) -> None:
    task_id = make(client, "t", "DELAYED", attempt=3)
    for attempt, outcome in enumerate(("SNOOZED", "RETRY", "LOST"), start=1):
        add_attempt(client, task_id, attempt, outcome)
    page = web.get(f"/tasks/{task_id}").text
    assert re.findall(r'class="attempt outcome-(\w+)"', page) == ["SNOOZED", "RETRY", "LOST"]
