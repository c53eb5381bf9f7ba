"""The record of operator actions from the CLI (``ax_audit``; ax_kombu.store.audit): every
state-changing command writes one row with the OS user or ``--as``; ``ax audit`` shows
them; a refused command writes none; ``ax archive`` (and so ``AX_RETENTION``) moves old
rows to ``ax_audit_archive``. On SQLite and PostgreSQL."""

from __future__ import annotations

import getpass
from typing import Any

import pytest
from sqlalchemy import select, update

from ax_kombu.api import Client
from ax_kombu.store.archive import archive_finished
from ax_kombu.store.audit import read_since, record
from ax_kombu.store.schema import audit, audit_archive

from .ax_cli import Ax
from .test_admin_cli import make

pytestmark = pytest.mark.timeout(120)

DAY = 86_400_000


def rows(client: Client, table: Any = audit) -> list[Any]:
    with client.store.engine.connect() as conn:
        return list(conn.execute(select(table).order_by(table.c.id)))


def test_each_cli_action_is_recorded_once_with_its_actor(ax: Ax, client: Client) -> None:
    waiting, failed = make(client, "t", "DELAYED"), make(client, "t", "FAILED")
    ax.ok("cancel", str(waiting))
    ax.ok("--as", "alice", "retry", str(failed))
    moved = make(client, "t", "DELAYED")
    ax.ok("--as", "alice", "reschedule", str(moved), "--delay", "10m")
    ax.ok("--as", "alice", "reschedule", str(moved), "--now")
    ax.ok("--as", "alice", "limits", "set", "t", "3")
    ax.ok("--as", "alice", "limits", "clear", "t")
    ax.ok("--as", "bob", "jobs", "add", "nightly", "t", "--every", "60s")
    for verb in ("pause", "resume", "run", "remove"):
        ax.ok("--as", "bob", "jobs", verb, "nightly")
    ax.ok("--as", "carol", "purge", "--status", "SUCCESS", "--older-than", "1d")
    ax.ok("--as", "carol", "archive", "--older-than", "1d")
    assert [(r.actor, r.via, r.action, r.target) for r in rows(client)] == [
        (getpass.getuser(), "cli", "cancel", f"task:{waiting}"),
        ("alice", "cli", "retry", f"task:{failed}"),
        ("alice", "cli", "reschedule", f"task:{moved}"),
        ("alice", "cli", "run_now", f"task:{moved}"),
        ("alice", "cli", "limit_set", "type:t"),
        ("alice", "cli", "limit_clear", "type:t"),
        ("bob", "cli", "job_add", "job:nightly"),
        ("bob", "cli", "job_pause", "job:nightly"),
        ("bob", "cli", "job_resume", "job:nightly"),
        ("bob", "cli", "job_run", "job:nightly"),
        ("bob", "cli", "job_remove", "job:nightly"),
        ("carol", "cli", "purge", "tasks:SUCCESS"),
        ("carol", "cli", "archive", "tasks:finished")]
    shown = ax.json("audit", "--since", "1h")
    assert [e["action"] for e in shown][:2] == ["archive", "purge"]  # newest first
    assert shown[-1]["actor"] == getpass.getuser() and shown[-1]["target"] == f"task:{waiting}"
    assert next(e for e in shown if e["action"] == "limit_set")["detail"] == {"max_running": 3}
    table = ax.ok("audit").splitlines()
    assert table[0].split() == ["at", "actor", "via", "action", "target", "detail"]
    assert len(table) == 14 and "alice" in table[-2]


def test_bulk_cancel_is_one_record_with_its_count(ax: Ax, client: Client) -> None:
    for _ in range(3):
        make(client, "bulk", "DELAYED")
    assert ax.ok("--as", "dave", "cancel", "--type", "bulk", "--yes").strip() == \
        "cancelled 3 task(s)"
    [entry] = rows(client)
    assert (entry.actor, entry.action, entry.target) == ("dave", "cancel", "tasks:bulk")
    assert '"cancelled": 3' in entry.detail


def test_a_refused_command_writes_no_record(ax: Ax, client: Client) -> None:
    done = make(client, "t", "SUCCESS")
    ax.fails(3, "cancel", "999")
    ax.fails(4, "cancel", str(done))
    ax.fails(2, "--as", "alice", "limits", "set", "t", "0")
    ax.fails(2, "audit", "--since", "soon")
    assert rows(client) == []
    assert ax.ok("audit").strip() == "(no recorded action in the last 1d)"


def test_archive_moves_old_records_to_the_audit_archive(ax: Ax, client: Client) -> None:
    engine = client.store.engine
    for n in range(3):
        record(engine, actor="old", via="api", action="cancel", target=f"task:{n}")
    record(engine, actor="new", via="api", action="cancel", target="task:9")
    with engine.begin() as conn:
        conn.execute(update(audit).where(audit.c.actor == "old")
                     .values(at=audit.c.at - 2 * DAY))
    done = archive_finished(engine, DAY, batch=2)  # AX_RETENTION's call; 2 batches
    assert done.audit == 3 and done.tasks == 0
    assert [r.actor for r in rows(client)] == ["new"]
    assert sorted(r.target for r in rows(client, audit_archive)) == ["task:0", "task:1",
                                                                     "task:2"]
    assert [e.actor for e in read_since(engine, 0)] == ["new"]
    again = ax.ok("archive", "--older-than", "1d")
    assert "audit record" not in again  # nothing older left; the run itself is recorded
    assert [r.action for r in rows(client)] == ["cancel", "archive"]
