"""``ax list``, ``ax retry``, ``ax purge``: the real console script against PostgreSQL."""

from __future__ import annotations

import itertools
import select as selectors
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from sqlalchemy import func, insert, select, update

from ax_kombu.api import Client
from ax_kombu.config import from_env
from ax_kombu.store.schema import attempts, tasks
from ax_kombu.store.tasks import WAKE_CHANNEL

from .ax_cli import Ax

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HOUR, DAY = 3_600_000, 86_400_000


@pytest.fixture
def client(pg_url: str, tmp_path: Path) -> Iterator[Client]:
    c = Client(from_env({}, database_url=pg_url,
                        broker_url=f"ax+sqlite:///{tmp_path / 'broker.sqlite3'}"))
    yield c
    c.close()


@pytest.fixture
def ax(pg_url: str) -> Ax:
    return Ax(pg_url)


_made = itertools.count()  # a payload of its own: no task is a duplicate of another


def make(client: Client, task_type: str, status: str = "CREATED", *, age_ms: int = 0,
         finished_ago_ms: int | None = None, **values: Any) -> int:
    """One task of ``task_type``, put in ``status`` by a direct UPDATE; created ``age_ms`` ago."""
    task_id = int(client.enqueue(task_type, {"n": next(_made)}, delay=3600,
                                 biz_key=values.pop("biz_key", None)))
    now = client.store.now_ms()
    if status in {"SUCCESS", "FAILED", "CANCELLED"}:
        values["finished_at"] = now - (finished_ago_ms or 0)
    with client.store.engine.begin() as conn:
        conn.execute(update(tasks).where(tasks.c.task_id == task_id)
                     .values(status=status, created_at=now - age_ms, **values))
    return task_id


def row(client: Client, task_id: int) -> Any:
    with client.store.engine.connect() as conn:
        return conn.execute(select(tasks).where(tasks.c.task_id == task_id)).one()


def everything(client: Client) -> tuple[list[Any], list[Any]]:
    with client.store.engine.connect() as conn:
        return (list(conn.execute(select(tasks).order_by(tasks.c.task_id))),
                list(conn.execute(select(attempts).order_by(attempts.c.task_id))))


def add_attempt(client: Client, task_id: int, attempt: int, outcome: str = "FAILED") -> None:
    with client.store.engine.begin() as conn:
        conn.execute(insert(attempts).values(
            task_id=task_id, attempt=attempt, task_type="t", node="w1", trigger_time=1,
            finished_at=client.store.now_ms(), outcome=outcome, error="boom"))


def attempt_rows(client: Client) -> dict[int, int]:
    with client.store.engine.connect() as conn:
        return dict(conn.execute(select(attempts.c.task_id, func.count())
                                 .group_by(attempts.c.task_id)).all())


# -- list ----------------------------------------------------------------------------------------

def test_list_filters_in_text_and_json(ax: Ax, client: Client) -> None:
    error = "Traceback: " + "x" * 100
    failed = make(client, "mail", "FAILED", age_ms=2 * HOUR, biz_key="k1", last_error=error,
                  owner_node="w1", attempt=3)
    waiting = make(client, "mail", age_ms=1000)
    cancelled = make(client, "sms", "CANCELLED", age_ms=1000)
    done = make(client, "sms", "SUCCESS", age_ms=3 * HOUR)
    with client.store.engine.begin() as conn:  # the same created_at: ordered by task_id
        conn.execute(update(tasks).where(tasks.c.task_id.in_([waiting, cancelled]))
                     .values(created_at=row(client, waiting).created_at))

    def ids(*args: str) -> list[int]:
        return [t["task_id"] for t in ax.json("list", *args)]

    newest_two = sorted([waiting, cancelled], reverse=True)
    assert ids() == [*newest_two, failed, done]
    assert ids("--status", "FAILED") == [failed]
    assert ids("--status", "cancelled") == [cancelled]
    assert ids("--type", "sms") == [cancelled, done]
    assert ids("--biz-key", "k1") == [failed]
    assert ids("--type", "sms", "--biz-key", "k1") == []
    assert ids("--since", "1h") == newest_two
    assert ids("--since", "150m", "--type", "mail") == [waiting, failed]
    assert ids("--limit", "3") == [*newest_two, failed]

    [view] = ax.json("list", "--status", "FAILED")
    assert view["last_error"] == error and view["owner_node"] == "w1"
    assert (view["task_type"], view["status"], view["attempt"], view["biz_key"]) == \
        ("mail", "FAILED", 3, "k1")
    trigger = datetime.fromisoformat(view["trigger_time"])
    assert trigger.utcoffset() == timedelta(0)
    assert int(trigger.timestamp() * 1000) == row(client, failed).trigger_time

    header, *lines = ax.ok("list").splitlines()
    assert header.split() == ["id", "type", "status", "trigger", "attempt", "owner_node",
                              "last_error"]
    assert [int(line.split()[0]) for line in lines] == [*newest_two, failed, done]
    cells = lines[2].split()
    assert cells[:3] == [str(failed), "mail", "FAILED"]
    assert cells[3] == view["trigger_time"] and cells[4:6] == ["3", "w1"]
    assert " ".join(cells[6:]) == error[:59] + "…"  # cut to 60 characters
    assert len({line.index("FAILED") for line in lines if "FAILED" in line} |
               {header.index("status")}) == 1  # aligned columns
    assert ax.ok("list", "--type", "nothing") == ""
    assert ax.json("list", "--type", "nothing") == []


# -- retry ---------------------------------------------------------------------------------------

def _notifications(url: str) -> Any:
    conn = psycopg2.connect(url)
    conn.autocommit = True
    conn.cursor().execute(f"LISTEN {WAKE_CHANNEL}")
    return conn


def _wait_notify(conn: Any, timeout_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while not conn.notifies and time.monotonic() < deadline:
        selectors.select([conn], [], [], 0.1)
        conn.poll()
    return [n.payload for n in conn.notifies]


def test_retry_by_id_moves_failed_to_ready_now_and_wakes_schedulers(
        ax: Ax, client: Client, pg_url: str) -> None:
    failed = make(client, "mail", "FAILED", finished_ago_ms=HOUR, retry_count=2,
                  last_error="boom", owner_node="w1", attempt=3, redispatches=4)
    add_attempt(client, failed, 1, "RETRY")
    add_attempt(client, failed, 3)
    listener = _notifications(pg_url)
    try:
        before = client.store.now_ms()
        assert ax.ok("retry", str(failed)).splitlines() == ["retried 1 task(s)"]
        after = client.store.now_ms()
        woken = _wait_notify(listener)
    finally:
        listener.close()

    moved = row(client, failed)
    assert moved.status == "READY" and before - 50 <= moved.trigger_time <= after + 50
    assert (moved.owner_node, moved.finished_at, moved.redispatches) == (None, None, 0)
    assert (moved.retry_count, moved.last_error, moved.attempt) == (2, "boom", 3)
    assert attempt_rows(client) == {failed: 2}  # the history keeps the old attempts
    assert woken and abs(int(woken[0]) - moved.trigger_time) <= 1

    again = ax.fails(4, "retry", str(failed))
    assert f"{failed} (READY)" in again
    assert row(client, failed).trigger_time == moved.trigger_time


def test_retry_some_ids_names_the_others(ax: Ax, client: Client) -> None:
    failed = make(client, "mail", "FAILED")
    cancelled = make(client, "mail", "CANCELLED")
    done = make(client, "mail", "SUCCESS")
    missing = 12345
    out = ax.json("retry", str(failed), str(done), str(cancelled), str(missing))
    assert sorted(out["retried"]) == sorted([failed, cancelled])
    assert out["not_retried"] == {str(done): "SUCCESS", str(missing): "not found"}
    assert {row(client, i).status for i in (failed, cancelled)} == {"READY"}

    text = ax.ok("retry", str(done), str(failed), str(make(client, "x", "FAILED")))
    assert text.splitlines() == ["retried 1 task(s)",
                                 f"not retried: {done} (SUCCESS), {failed} (READY)"]


def test_retry_of_a_success_task_is_refused(ax: Ax, client: Client) -> None:
    done = make(client, "mail", "SUCCESS")
    before = everything(client)
    line = ax.fails(4, "retry", str(done))
    assert f"{done} (SUCCESS)" in line
    assert "12 (not found)" in ax.fails(4, "retry", "12")
    ax.fails(2, "retry", "--type", "mail", "--status", "SUCCESS")
    assert everything(client) == before


def test_bulk_retry_by_type_and_status(ax: Ax, client: Client) -> None:
    mail_failed = [make(client, "mail", "FAILED", finished_ago_ms=60_000) for _ in range(3)]
    old_failed = make(client, "mail", "FAILED", finished_ago_ms=2 * HOUR)
    sms_failed = make(client, "sms", "FAILED")
    mail_cancelled = make(client, "mail", "CANCELLED")
    mail_done = make(client, "mail", "SUCCESS")

    assert ax.ok("retry", "--type", "mail", "--status", "FAILED", "--since", "1h",
                 "--limit", "2").strip() == "retried 2 task(s)"
    assert [row(client, i).status for i in mail_failed] == ["READY", "READY", "FAILED"]
    out = ax.json("retry", "--type", "mail", "--status", "FAILED", "--since", "1h")
    assert out == {"retried": [mail_failed[2]], "not_retried": {}}
    assert row(client, old_failed).status == "FAILED"  # failed before --since
    assert ax.json("retry", "--type", "mail", "--status", "FAILED") == \
        {"retried": [old_failed], "not_retried": {}}
    assert ax.ok("retry", "--type", "mail", "--status", "FAILED").strip() == \
        "retried 0 task(s)"
    assert row(client, sms_failed).status == "FAILED"
    assert row(client, mail_cancelled).status == "CANCELLED"
    assert ax.json("retry", "--type", "mail", "--status", "CANCELLED")["retried"] == \
        [mail_cancelled]
    assert row(client, mail_cancelled).status == "READY"
    assert row(client, mail_done).status == "SUCCESS"


# -- purge ---------------------------------------------------------------------------------------

def test_purge_deletes_old_finished_rows_of_the_status_and_their_attempts(
        ax: Ax, client: Client) -> None:
    old = [make(client, "mail", "SUCCESS", finished_ago_ms=10 * DAY) for _ in range(5)]
    recent = make(client, "mail", "SUCCESS", finished_ago_ms=DAY)
    old_failed = make(client, "mail", "FAILED", finished_ago_ms=10 * DAY)
    waiting = make(client, "mail", age_ms=10 * DAY)
    for task_id, attempt in ((old[0], 1), (old[0], 2), (old[3], 1), (recent, 1),
                             (old_failed, 1)):
        add_attempt(client, task_id, attempt)
    before = everything(client)

    assert ax.ok("purge", "--status", "SUCCESS", "--older-than", "7d", "--dry-run").strip() \
        == "would delete 5 SUCCESS task(s) and 3 attempt row(s)"
    assert ax.json("purge", "--status", "SUCCESS", "--older-than", "7d", "--dry-run") == \
        {"status": "SUCCESS", "older_than_ms": 7 * DAY, "dry_run": True, "tasks": 5,
         "attempts": 3}
    assert everything(client) == before

    done = ax.json("purge", "--status", "SUCCESS", "--older-than", "7d", "--batch", "2")
    assert (done["tasks"], done["attempts"], done["dry_run"]) == (5, 3, False)
    assert [r.task_id for r in everything(client)[0]] == sorted([recent, old_failed, waiting])
    assert attempt_rows(client) == {recent: 1, old_failed: 1}

    assert ax.ok("purge", "--status", "success", "--older-than", "7d").strip() == \
        "deleted 0 SUCCESS task(s) and 0 attempt row(s)"
    assert ax.ok("purge", "--status", "FAILED", "--older-than", "7d").strip() == \
        "deleted 1 FAILED task(s) and 1 attempt row(s)"
    assert [r.task_id for r in everything(client)[0]] == sorted([recent, waiting])


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("args,words", [
    (("list", "--status", "DONE"), "CREATED, DELAYED, READY"),
    (("list", "--limit", "-1"), "--limit"),
    (("list", "--limit", "10001"), "--limit"),
    (("list", "--since", "yesterday"), "not a duration"),
    (("retry", "--type", "mail", "--status", "RUNNING"), "FAILED, CANCELLED"),
    (("retry", "--type", "mail", "--status", "FAILED", "--limit", "-5"), "--limit"),
    (("retry", "--type", "mail", "--status", "FAILED", "--since", "1 week"), "not a duration"),
    (("retry", "--type", "mail"), "--status"),
    (("retry",), "task ids"),
    (("retry", "1", "--type", "mail"), "not both"),
    (("purge", "--status", "READY", "--older-than", "7d"), "SUCCESS, FAILED, CANCELLED"),
    (("purge", "--status", "SUCCESS", "--older-than", "-7d"), "not a duration"),
    (("purge", "--status", "SUCCESS", "--older-than", "7d", "--batch", "0"), "--batch"),
])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(ax: Ax, client: Client,
                                                         args: tuple[str, ...],
                                                         words: str) -> None:
    make(client, "mail", "FAILED", finished_ago_ms=10 * DAY)
    make(client, "mail", "SUCCESS", finished_ago_ms=10 * DAY)
    before = everything(client)
    assert words in ax.fails(2, *args)
    assert everything(client) == before
