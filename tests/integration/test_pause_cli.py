"""``ax pause-type``, ``ax resume-type``, ``ax queues list|pause|resume``, ``ax pauses`` and
``ax status`` on SQLite and PostgreSQL: what they print, the audit record of each change
(as the OS user, or ``--as``), and a bad name refused with one line, changing nothing."""

from __future__ import annotations

import getpass
from datetime import UTC, datetime, timedelta

from ax_kombu.api import Client

from .ax_cli import Ax
from .console import audit_rows


def test_pause_list_status_and_resume(ax: Ax, client: Client) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    client.enqueue_many([{"task_type": "sms.send", "payload": i, "run_at": later}
                         for i in range(3)] + [{"task_type": "r", "priority": "slow",
                                                "run_at": later}])
    assert ax.ok("pause-type", "sms.send") == "type sms.send: paused\n"
    assert ax.ok("pause-type", "sms.send") == "type sms.send: already paused\n"
    assert ax.ok("--as", "alice", "queues", "pause", "slow") == "queue slow: paused\n"
    assert [q["paused"] for q in ax.json("queues", "list")] == [False, False, True]
    assert [(p["kind"], p["name"], p["actor"]) for p in ax.json("pauses")] == [
        ("type", "sms.send", getpass.getuser()), ("queue", "slow", "alice")]
    shown = ax.json("status", "--no-broker")["paused"]
    assert [(p["kind"], p["name"], p["waiting"]) for p in shown] == [
        ("type", "sms.send", 3), ("queue", "slow", 1)]
    assert "paused  type sms.send (3 waiting" in ax.ok("status", "--no-broker")
    assert ax.ok("resume-type", "sms.send") == "type sms.send: resumed\n"
    assert ax.ok("queues", "resume", "slow") == "queue slow: resumed\n"
    assert ax.ok("queues", "resume", "slow") == "queue slow: was not paused\n"
    assert ax.ok("pauses") == "(nothing paused)\n"
    me = getpass.getuser()
    assert audit_rows(client) == [
        (me, "cli", "pause_type", "type:sms.send"), (me, "cli", "pause_type", "type:sms.send"),
        ("alice", "cli", "pause_queue", "queue:slow"),
        (me, "cli", "resume_type", "type:sms.send"), (me, "cli", "resume_queue", "queue:slow"),
        (me, "cli", "resume_queue", "queue:slow")]


def test_a_bad_name_is_one_line_and_changes_nothing(ax: Ax, client: Client) -> None:
    line = ax.fails(2, "queues", "pause", "no-such-queue")
    assert "unknown queue 'no-such-queue'" in line and "high, default, slow" in line
    assert "task_type" in ax.fails(2, "pause-type", " ")
    assert client.pauses() == [] and audit_rows(client) == []
