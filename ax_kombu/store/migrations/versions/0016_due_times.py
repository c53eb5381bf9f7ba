"""``ax_due``: a narrow, append-mostly table of the times claimable tasks fall due, which the
scheduler's steady preload rounds read instead of ``ax_task``.

Why: PostgreSQL puts a new row on any page its free-space map says has room, and a big
``ax_task`` (millions of finished rows, fillfactor 70, rows of varying size) has hundreds of
thousands of pages with room for one more. The 10,000 tasks a producer enqueues for one
second land on 10,000 heap pages at 10M rows against 417 at 10k, and the preload that reads
that window fetches each of them (``python -m bench.bigtable``: docs/benchmarks.md,
"Issue 24"). An ``ax_due`` entry is four numbers wide, lives only until its task has left
the time it names, and so the entries written together stay together (tens of pages for
10,000), whatever the size of ``ax_task``.

**The invariant** the preload relies on: every claimable (CREATED, DELAYED, READY), unparked
task has an entry at its current trigger time, armed (as ``ax_task.armed``, migration 0011)
by a transaction at or after the one that last made it so — made claimable, given a new
trigger time, or woken from parked. The database keeps it, whoever writes:

* **PostgreSQL**: a statement-level ``AFTER INSERT`` trigger adds the entries of the
  statement's new claimable rows in one ``INSERT … SELECT`` (an enqueue of 1,000 is one
  statement); a row-level ``AFTER UPDATE`` trigger, whose ``WHEN`` (tested without calling
  anything) passes only the updates that make a row due at a new time, adds one entry each.
  ``armed`` is the writer's transaction id, by the column's default.
* **SQLite**: 0011's two triggers, remade to add the entry with the counter they bump.

An entry is never updated. One that no longer describes its task (the task was claimed,
cancelled, parked or given another time) is harmless: the preload hands it to the timing
loop, and the claim's compare-and-set, which checks the status and the trigger time, refuses
it (:func:`ax_kombu.store.claims.claim`; :func:`~ax_kombu.store.claims.still_claimable`
re-times one moved later). The schedulers delete such entries once their time has passed
(:func:`ax_kombu.store.preload.prune_due`): an entry whose task is still claimable at that
time is kept, however overdue, so a scheduler that lags behind never finds its next entries
pruned.

Indexes: ``(trigger_time)`` — the preload's band and the prune; ``(armed)`` — the preload's
"what became due since my last read". No primary key: an entry is found by these alone.

Existing claimable rows get their entries here (one ``INSERT … SELECT``: seconds per million
such rows). ``ax_task.armed``, its trigger and its index stay: a scheduler of the previous
release, still running during a rolling upgrade, reads them, and a first preload round (or
a changed share) still reads ``ax_task`` itself.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

CLAIMABLE = "status IN ('CREATED', 'DELAYED', 'READY')"
PARKED = "'~parked'"


def _due(row: str) -> str:
    """SQL: ``row`` (NEW, OLD, or a table's alias) is claimable and not parked."""
    return (f"{row}.{CLAIMABLE} AND ({row}.last_run_node IS NULL "
            f"OR {row}.last_run_node <> {PARKED})")


#: an update that makes a row due at a new time: claimable now and not parked, and before
#: not claimable, or at another time, or parked
_NEWLY_DUE = (f"{_due('NEW')} AND (OLD.status NOT IN ('CREATED', 'DELAYED', 'READY') "
              f"OR OLD.trigger_time <> NEW.trigger_time "
              f"OR COALESCE(OLD.last_run_node, '') = {PARKED})")

_PG_UP = [
    "ALTER TABLE ax_due ALTER COLUMN armed SET DEFAULT (pg_current_xact_id()::text::bigint)",
    f"""CREATE FUNCTION ax_due_added() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ax_due (task_id, trigger_time, runner)
    SELECT task_id, trigger_time, runner FROM added AS a WHERE {_due('a')};
    RETURN NULL;
END $$""",
    """CREATE TRIGGER ax_due_insert AFTER INSERT ON ax_task REFERENCING NEW TABLE AS added
    FOR EACH STATEMENT EXECUTE FUNCTION ax_due_added()""",
    """CREATE FUNCTION ax_due_moved() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ax_due (task_id, trigger_time, runner)
    VALUES (NEW.task_id, NEW.trigger_time, NEW.runner);
    RETURN NULL;
END $$""",
    f"""CREATE TRIGGER ax_due_update AFTER UPDATE ON ax_task FOR EACH ROW
    WHEN ({_NEWLY_DUE}) EXECUTE FUNCTION ax_due_moved()""",
    f"""INSERT INTO ax_due (task_id, trigger_time, runner)
    SELECT task_id, trigger_time, runner FROM ax_task AS t WHERE {_due('t')}""",
]
_PG_DOWN = ["DROP TRIGGER IF EXISTS ax_due_update ON ax_task",
            "DROP TRIGGER IF EXISTS ax_due_insert ON ax_task",
            "DROP FUNCTION IF EXISTS ax_due_moved()", "DROP FUNCTION IF EXISTS ax_due_added()"]

# SQLite: 0011's triggers, each adding the entry under the counter value it just took
_SQLITE_ARM = ("UPDATE ax_armed SET n = n + 1; "
               "UPDATE ax_task SET armed = (SELECT n FROM ax_armed) "
               "WHERE task_id = NEW.task_id;")
_SQLITE_ADD = ("INSERT INTO ax_due (task_id, trigger_time, runner, armed) "
               "SELECT NEW.task_id, NEW.trigger_time, NEW.runner, n FROM ax_armed WHERE {when};")
_SQLITE_TRIGGERS = {
    "ax_task_arm_insert": ("AFTER INSERT ON ax_task", _due("NEW")),
    "ax_task_arm_update": ("AFTER UPDATE OF status, trigger_time, last_run_node ON ax_task",
                           _NEWLY_DUE),
}


def _sqlite_triggers(with_due: bool) -> list[str]:
    out = []
    for name, (event, when) in _SQLITE_TRIGGERS.items():
        body = _SQLITE_ARM + (_SQLITE_ADD.format(when=when) if with_due else "")
        out += [f"DROP TRIGGER IF EXISTS {name}",
                f"CREATE TRIGGER {name} {event} WHEN NEW.{CLAIMABLE} BEGIN {body} END"]
    return out


_SQLITE_UP = [*_sqlite_triggers(with_due=True),
              f"""INSERT INTO ax_due (task_id, trigger_time, runner, armed)
    SELECT task_id, trigger_time, runner, COALESCE(armed, 0) FROM ax_task AS t
     WHERE {_due('t')}"""]


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    op.create_table(
        "ax_due",
        sa.Column("task_id", sa.BigInteger(), nullable=False),
        sa.Column("trigger_time", sa.BigInteger(), nullable=False),
        sa.Column("runner", sa.String(12), nullable=False),
        sa.Column("armed", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_ax_due_time", "ax_due", ["trigger_time"])
    op.create_index("ix_ax_due_armed", "ax_due", ["armed"])
    for statement in _PG_UP if postgres else _SQLITE_UP:
        op.execute(statement)


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    for statement in _PG_DOWN if postgres else _sqlite_triggers(with_due=False):
        op.execute(statement)
    op.drop_table("ax_due")
