"""The console in a real browser: headless chromium (Debian's package, driven by
Playwright) against real ``ax-scheduler``, ``ax-worker`` and ``ax web`` processes on
PostgreSQL and Redis, with ``AX_WEB_TOKEN`` set.

It logs in, sees both nodes on the overview, finds a failed task by its biz_key, reads
its attempts and error, retries it and sees it SUCCESS, runs a task due in an hour at once
(Run now) and sees it end SUCCESS, pauses a recurring job and sees no new occurrence for
3 s, sets a limit; a visitor without the session cookie is sent to the
login form, and a POST without the CSRF token is refused with 403 and changes nothing. It
saves the screenshots the README shows (docs/img/console-*.png).

With users from an ``AX_WEB_USERS`` file (issue 40): a viewer logs in with their password,
sees no Cancel button, and their POST cancel (with the page's CSRF token) is refused with
403 and changes nothing; an operator cancels the same task from its page and finds the
cancel under their name on ``/audit``.

Run it alone: ``bash scripts/test.sh -m browser`` (the main run deselects it). Without
chromium it is skipped, with the reason; with ``AX_REQUIRE_SERVICES=1`` it fails.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ax_kombu.web.users import add_user

from ..e2e.system import REPO, Daemon, System, stop_all
from ..faults.servers import free_port
from ..services import unavailable
from .console_tasks import FAILURE

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.integration,
              pytest.mark.timeout(240)]

TOKEN = "browser-test-token"
JOB = "web.heartbeat"
SHOTS = REPO / "docs" / "img"
#: how long a paused job must stay silent (s)
QUIET_S = 3.0
#: the users file's users: name → (role, password)
USERS = {"vera": ("viewer", "vera-password"), "otto": ("operator", "otto-password")}


def chromium() -> str:
    """The system's chromium, or skip (fail under AX_REQUIRE_SERVICES=1) saying why."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        unavailable("chromium", "not installed (apt-get install -y chromium; "
                                "'playwright install' cannot download here)")
    return found


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


@pytest.fixture
def system(pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> Iterator[System]:
    ax = System(pg_url, redis_broker, tmp_path)
    yield ax
    ax.close()


@pytest.fixture
def console(system: System, tmp_path: Path) -> Iterator[str]:
    """``python -m ax_kombu web`` on a free port, with the token and a users file of
    :data:`USERS`; yields its base URL."""
    port = free_port()
    log = tmp_path / "web.log"
    users = tmp_path / "web-users"
    for name, (role, password) in USERS.items():
        add_user(users, name, role, password)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ax_kombu", "web", "--port", str(port)],
                                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                env={**system.daemon_env(), "AX_WEB_TOKEN": TOKEN,
                                     "AX_WEB_USERS": str(users)})
    web = Daemon("web", "web", proc, log)  # not a node: System.wait_ready does not wait for it
    base = f"http://127.0.0.1:{port}"
    try:
        system.wait_for(lambda: answers(f"{base}/login") or not web.alive, 60, "ax web answers")
        assert web.alive, f"ax web exited:\n{web.tail()}"
        yield base
    finally:
        stop_all([proc])


@pytest.fixture
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    path = chromium()
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=path, headless=True)
        yield launched
        launched.close()


def occurrences(system: System) -> set[int]:
    return {r[0] for r in system.query("SELECT task_id FROM ax_task WHERE job = :j", j=JOB)}


def test_console_in_a_browser(system: System, console: str, browser: Any) -> None:
    from playwright.sync_api import expect

    system.scheduler("sched-web")
    system.worker("worker-web", args=["-A", "tests.browser.console_tasks"])
    system.wait_ready()
    system.client.schedule(JOB, "web.tick", every=1, processor="web.tick")
    failed = int(system.client.enqueue("web.flaky", {"order": 7}, biz_key="order-7",
                                       processor="web.flaky", max_retry=0))
    system.enqueue_many([{"task_type": "web.tick", "payload": {"n": i}, "delay": i / 20,
                          "processor": "web.tick"} for i in range(40)])
    system.wait_for(lambda: system.client.get(failed).status == "FAILED", 60, "the task failed")

    # -- no session: every page sends to the login form; a POST is refused ---------------
    stranger = browser.new_context()
    page = stranger.new_page()
    page.goto(f"{console}/tasks/{failed}")
    expect(page).to_have_url(f"{console}/login?next=/tasks/{failed}")
    refused = stranger.request.post(f"{console}/tasks/{failed}/retry", form={"x": "1"})
    assert refused.status == 403
    stranger.close()

    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())  # the actions' confirmations
    page.goto(console)
    page.fill("input[name=token]", TOKEN)
    page.click("button:text('Log in')")
    expect(page).to_have_url(f"{console}/")

    # -- logged in, but a POST without the CSRF token: 403, nothing changes ------------------
    forged = page.request.post(f"{console}/tasks/{failed}/retry", form={"x": "1"})
    assert forged.status == 403
    assert system.client.get(failed).status == "FAILED"

    # -- overview: both nodes, refreshed in place -------------------------------------------
    live = page.locator("#live")
    expect(live.locator("tr[data-node='sched-web']")).to_be_visible()
    expect(live.locator("tr[data-node='worker-web']")).to_contain_text("worker")
    first = live.get_attribute("data-refreshed-at")
    system.wait_for(lambda: live.get_attribute("data-refreshed-at") not in (None, first), 15,
                    "the overview refreshed itself")

    # -- the failed task, found by biz_key: attempts, error, retry → SUCCESS ------------------
    page.click("nav >> text=Tasks")
    page.fill("input[name=biz_key]", "order-7")
    page.click("button:text('Search')")
    page.click(f"a[href='/tasks/{failed}']")
    expect(page.locator("#status")).to_have_text("FAILED")
    expect(page.locator("tr.attempt.outcome-FAILED")).to_contain_text(FAILURE)
    page.click("button:text('Retry')")
    expect(page.locator(".note")).to_contain_text("Retried")

    def shows_success() -> bool:
        page.reload()
        return bool(page.locator("#status").inner_text() == "SUCCESS")

    system.wait_for(shows_success, 30, "the retried task shows SUCCESS")
    expect(page.locator("tr.attempt")).to_have_count(2)
    page.screenshot(path=str(SHOTS / "console-task.png"), full_page=True)

    # -- a task due in an hour: Run now → it runs, its move listed ------------------------------
    later = int(system.client.enqueue("web.tick", {"later": True}, delay=3600,
                                      processor="web.tick"))
    page.goto(f"{console}/tasks/{later}")
    expect(page.locator("#status")).to_have_text("DELAYED")
    page.click("button:text('Run now')")
    expect(page.locator(".note")).to_contain_text("Moved to now")
    system.wait_for(lambda: system.client.get(later).status == "SUCCESS", 30,
                    "the task moved to now ran")
    page.reload()
    expect(page.locator("tr.move.kind-run_now")).to_have_count(1)

    # -- jobs: pause, then no new occurrence for 3 s --------------------------------------------
    system.wait_for(lambda: len(occurrences(system)) >= 2, 30, "the job fired")
    page.click("nav >> text=Jobs")
    job = page.locator(f"section[data-job='{JOB}']")
    expect(job.locator("ol.fires li")).to_have_count(5)
    job.locator("button:text('Pause')").click()
    expect(job.locator(".badge.paused")).to_be_visible()
    assert system.client.job(JOB).paused
    after_pause = occurrences(system)
    quiet_until = time.monotonic() + QUIET_S
    while time.monotonic() < quiet_until:  # holds for the whole span, checked every 0.2 s
        assert occurrences(system) <= after_pause, "a paused job made an occurrence"
        time.sleep(0.2)
    page.reload()
    expect(job.locator(".badge.paused")).to_be_visible()

    # -- limits: set one --------------------------------------------------------------------------
    page.click("nav >> text=Limits")
    page.fill("input[name=task_type]", "web.tick")
    page.fill("input[name=max_running]", "3")
    page.click("button:text('Set')")
    expect(page.locator("tr[data-type='web.tick']")).to_contain_text("3")
    assert system.client.limits() == {"web.tick": 3}

    page.click("nav >> text=Overview")
    expect(page.locator("#live tr[data-node='worker-web']")).to_be_visible()
    page.screenshot(path=str(SHOTS / "console-overview.png"), full_page=True)
    context.close()


def log_in_as(browser: Any, console: str, name: str) -> Any:
    """A new browser context logged in as user ``name``; returns its page."""
    from playwright.sync_api import expect

    page = browser.new_context().new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    page.goto(console)
    page.fill("input[name=user]", name)
    page.fill("input[name=password]", USERS[name][1])
    page.click("button:text('Log in')")
    expect(page).to_have_url(f"{console}/")
    expect(page.locator("#me")).to_contain_text(f"{name} ({USERS[name][0]})")
    return page


def test_roles_and_the_audit_in_a_browser(system: System, console: str, browser: Any) -> None:
    from playwright.sync_api import expect

    waiting = int(system.client.enqueue("web.tick", {"roles": True}, delay=3600,
                                        processor="web.tick"))

    # -- a viewer: reads the task, has no Cancel button, and a POST cancel is refused -------
    viewer = log_in_as(browser, console, "vera")
    viewer.goto(f"{console}/tasks/{waiting}")
    expect(viewer.locator("#status")).to_have_text("DELAYED")
    expect(viewer.locator("button:text('Cancel')")).to_have_count(0)
    token = viewer.locator("input[name=csrf]").first.get_attribute("value")
    refused = viewer.request.post(f"{console}/tasks/{waiting}/cancel", form={"csrf": token})
    assert refused.status == 403 and "needs the operator role" in refused.text()
    assert system.client.get(waiting).status == "DELAYED"
    viewer.context.close()

    # -- an operator: cancels it from its page, and /audit shows the cancel under their name -
    operator = log_in_as(browser, console, "otto")
    operator.goto(f"{console}/tasks/{waiting}")
    operator.click("button:text('Cancel')")
    expect(operator.locator(".note")).to_contain_text("Cancelled")
    expect(operator.locator("#status")).to_have_text("CANCELLED")
    assert system.client.get(waiting).status == "CANCELLED"
    operator.click("nav >> text=Audit")
    entry = operator.locator(f"tr.audit-entry[data-target='task:{waiting}']")
    expect(entry).to_have_count(1)
    expect(entry.locator(".actor")).to_have_text("otto")
    expect(entry.locator(".action")).to_have_text("cancel")
    operator.context.close()
