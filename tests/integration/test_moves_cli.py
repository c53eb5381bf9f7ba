"""``ax reschedule``, ``ax cancel`` (one task by id or key, and in bulk) and the moves in
``ax inspect``: the real console script against PostgreSQL."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from ax_kombu.api import Client
from ax_kombu.config import from_env
from ax_kombu.store.schema import tasks

from .ax_cli import Ax, run_ax
from .test_admin_cli import HOUR, add_attempt, make, row

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MINUTE = 60_000
#: how far a delay's trigger time may land from now + delay (two processes' start-up)
SLACK_MS = 15_000


@pytest.fixture
def client(pg_url: str, tmp_path: Path) -> Iterator[Client]:
    c = Client(from_env({}, database_url=pg_url,
                        broker_url=f"ax+sqlite:///{tmp_path / 'broker.sqlite3'}"))
    yield c
    c.close()


@pytest.fixture
def ax(pg_url: str) -> Ax:
    return Ax(pg_url)


def answered(ax: Ax, answer: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``ax ARGS`` with ``answer`` on its standard input (a confirmation's reply)."""
    return run_ax(*args, env=ax.env, answer=answer)


def printed_time(line: str) -> int:
    """The trigger time ``ax reschedule`` printed (``ID STATUS ISO``), in epoch ms."""
    at = datetime.fromisoformat(line.split()[2])
    assert at.utcoffset() == timedelta(0)
    return round(at.timestamp() * 1000)


# -- reschedule ----------------------------------------------------------------------------------

def test_reschedule_by_id_with_delay_and_by_key_with_at(ax: Ax, client: Client) -> None:
    by_id = int(client.enqueue("mail", {"n": 1}, delay=3600))
    before = client.store.now_ms()
    out = ax.ok("reschedule", str(by_id), "--delay", "10m").strip()
    assert out.split()[:2] == [str(by_id), "DELAYED"]
    moved = row(client, by_id)
    assert printed_time(out) == moved.trigger_time
    assert before + 10 * MINUTE <= moved.trigger_time <= before + 10 * MINUTE + SLACK_MS

    by_key = int(client.enqueue("mail", {"n": 2}, delay=3600, biz_key="order-9"))
    out = ax.ok("reschedule", "--type", "mail", "--biz-key", "order-9",
                "--at", "2030-01-01T08:00:00+08:00").strip()
    expected = int(datetime(2030, 1, 1, tzinfo=UTC).timestamp() * 1000)
    assert row(client, by_key).trigger_time == expected == printed_time(out)
    assert out.startswith(f"{by_key} DELAYED ")

    out = ax.ok("reschedule", "--type", "mail", "--biz-key", "order-9", "--now").strip()
    assert out.split()[:2] == [str(by_key), "READY"]
    assert row(client, by_key).trigger_time <= client.store.now_ms()
    assert [m.kind for m in client.get(by_key).moves] == ["reschedule", "run_now"]


def test_reschedule_refuses_a_naive_time_and_bad_forms(ax: Ax, client: Client) -> None:
    task_id = int(client.enqueue("mail", {"n": 3}, delay=3600, biz_key="k"))
    due = row(client, task_id).trigger_time
    assert "offset" in ax.fails(2, "reschedule", str(task_id), "--at", "2030-01-01T08:00:00")
    assert "ISO 8601" in ax.fails(2, "reschedule", str(task_id), "--at", "tomorrow")
    assert "not both" in ax.fails(2, "reschedule", str(task_id), "--biz-key", "k",
                                  "--delay", "1m")
    assert "exactly one" in ax.fails(2, "reschedule", str(task_id))
    assert "exactly one" in ax.fails(2, "reschedule", str(task_id), "--delay", "1m", "--now")
    assert "--type" in ax.fails(2, "reschedule", "--biz-key", "k", "--delay", "1m")
    assert row(client, task_id).trigger_time == due
    assert client.get(task_id).moves == ()


def test_reschedule_of_a_started_or_finished_task_exits_4(ax: Ax, client: Client) -> None:
    done = make(client, "mail", "SUCCESS")
    line = ax.fails(4, "reschedule", str(done), "--delay", "1m")
    assert "SUCCESS" in line
    running = make(client, "mail", "DISPATCHING", attempt=1,
                   trigger_time=client.store.now_ms() - 1000)
    assert "already started" in ax.fails(4, "reschedule", str(running), "--now")
    assert row(client, running).status == "DISPATCHING"
    assert ax.fails(3, "reschedule", "--type", "mail", "--biz-key", "nope", "--now")


# -- cancel --------------------------------------------------------------------------------------

def test_cancel_by_key_and_the_usage_errors(ax: Ax, client: Client) -> None:
    task_id = make(client, "mail", "DELAYED", biz_key="order-1")
    other = make(client, "mail", "DELAYED", biz_key="order-2")
    assert "not both" in ax.fails(2, "cancel", str(task_id), "--biz-key", "order-1")
    assert "not both" in ax.fails(2, "cancel", str(task_id), "--type", "mail")
    assert "never" in ax.fails(2, "cancel")
    assert row(client, task_id).status == "DELAYED"

    assert ax.ok("cancel", "--type", "mail", "--biz-key", "order-1").strip() == \
        f"{task_id} CANCELLED"
    assert "CANCELLED" in ax.fails(4, "cancel", "--type", "mail", "--biz-key", "order-1")
    ax.fails(3, "cancel", "--type", "mail", "--biz-key", "order-404")
    assert ax.ok("cancel", str(other)).strip() == f"{other} CANCELLED"  # by id, as before


def test_bulk_cancel_with_filters_and_yes(ax: Ax, client: Client) -> None:
    young = make(client, "bulk", "DELAYED", age_ms=1000)
    old = make(client, "bulk", "DELAYED", age_ms=2 * HOUR)
    ready = make(client, "bulk", "READY", age_ms=1000)
    done = make(client, "bulk", "SUCCESS", age_ms=1000)
    keyed = [make(client, "bulk", "CREATED", biz_key=k) for k in ("a", "b", "c")]
    elsewhere = make(client, "other", "DELAYED", age_ms=1000)

    assert ax.ok("cancel", "--type", "bulk", "--status", "delayed", "--since", "1h",
                 "--yes").strip() == "cancelled 1 task(s)"
    assert row(client, young).status == "CANCELLED"
    assert [row(client, t).status for t in (old, ready, done, elsewhere)] == \
        ["DELAYED", "READY", "SUCCESS", "DELAYED"]

    assert ax.ok("cancel", "--type", "bulk", "--biz-key", "a", "--biz-key", "b",
                 "-y").strip() == "cancelled 2 task(s)"
    assert [row(client, t).status for t in keyed] == ["CANCELLED", "CANCELLED", "CREATED"]

    assert "SUCCESS" in ax.fails(2, "cancel", "--type", "bulk", "--status", "success", "--yes")
    ax.fails(2, "cancel", "--type", "bulk", "--since", "soon", "--yes")

    refused = answered(ax, "n\n", "cancel", "--type", "bulk")
    assert refused.returncode == 1 and "Cancel every unfinished task of type 'bulk'" in \
        refused.stdout
    assert [row(client, t).status for t in (old, ready, keyed[2])] == \
        ["DELAYED", "READY", "CREATED"]
    agreed = answered(ax, "y\n", "cancel", "--type", "bulk")
    assert agreed.returncode == 0 and "cancelled 3 task(s)" in agreed.stdout, agreed.stderr
    assert [row(client, t).status for t in (old, ready, keyed[2], done, elsewhere)] == \
        ["CANCELLED", "CANCELLED", "CANCELLED", "SUCCESS", "DELAYED"]


# -- inspect -------------------------------------------------------------------------------------

def test_inspect_shows_moves_and_outcome_kinds(ax: Ax, client: Client) -> None:
    task_id = int(client.enqueue("mail", {"n": 4}, delay=3600))
    first = row(client, task_id).trigger_time
    ax.ok("reschedule", str(task_id), "--delay", "2h")
    add_attempt(client, task_id, 1, outcome="SNOOZED")
    with client.store.engine.begin() as conn:
        conn.execute(update(tasks).where(tasks.c.task_id == task_id).values(attempt=1))
    view = json.loads(ax.ok("inspect", str(task_id), "--json"))
    [move] = view["moves"]
    assert move["kind"] == "reschedule" and move["attempt"] == 0
    assert round(datetime.fromisoformat(move["from_time"]).timestamp() * 1000) == first
    assert [a["outcome"] for a in view["attempts"]] == ["SNOOZED"]

    text = ax.ok("inspect", str(task_id))
    assert "moves: 1" in text and "attempts: 1" in text
    [line] = [t for t in text.splitlines() if "→" in t]
    assert line.split()[1:5] == [move["from_time"], "→", move["to_time"], "reschedule"]
    assert any(t.split()[1:2] == ["SNOOZED"] for t in text.splitlines() if "#1" in t)


def test_enqueue_takes_the_key_policies_and_an_offset_time(ax: Ax) -> None:
    first = ax.ok("enqueue", "digest", "--payload", '{"n": 1}', "--biz-key", "u1",
                  "--delay", "10m").strip()
    again = ax.ok("enqueue", "digest", "--payload", '{"n": 2}', "--biz-key", "u1",
                  "--delay", "20m", "--on-conflict", "replace")
    assert again.startswith(first) and "replaced" in again
    assert "no UTC offset" in ax.fails(2, "enqueue", "digest", "--at", "2030-01-01T00:00:00")
