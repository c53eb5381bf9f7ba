"""``ax_task.last_run_node`` splits into ``owner_node`` and ``parked``.

``last_run_node`` named three things: the scheduler that claimed a task, the worker that
runs it, and, with the marker value ``'~parked'``, a gated task waiting READY for its key or
limit (:mod:`ax_kombu.store.gates`). Each gets its own column:

* ``owner_node`` (text, NULL): the node that last took the task — the claiming scheduler,
  then the running worker; NULL once a scheduler may claim it again.
* ``parked`` (boolean, NOT NULL, default false): the gated claim parked it; no preload
  reads it until a run's end (or the recovery's backstop) wakes it.

Rows move over as they are (``parked`` where the marker was, ``owner_node`` the other
names), in ``ax_task`` and ``ax_task_archive``; then ``last_run_node`` goes. The triggers
that keep ``ax_due`` (migrations 0016, 0018) tested the marker: they are remade on
``parked``, with the same events and the same effect. No index filtered on the column
(``ix_ax_task_unheld`` went in 0011), so none is remade.

Stop the workers and schedulers of an earlier release before this migration: they write
and read ``last_run_node``. The downgrade puts the column back from the two (the marker
where ``parked``).

Revision ID: 0021
Revises: 0020
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

CLAIMABLE = "status IN ('CREATED', 'DELAYED', 'READY')"
MARKER = "'~parked'"
_TABLES = ("ax_task", "ax_task_archive")


def _due(row: str, parked: str) -> str:
    """SQL: ``row`` is claimable and not parked, ``parked(row)`` testing the latter."""
    return f"{row}.{CLAIMABLE} AND {parked.format(r=row)}"


#: "not parked" and "was parked" before and after the split
_NOT_PARKED = {"new": "NOT {r}.parked",
               "old": f"({{r}}.last_run_node IS NULL OR {{r}}.last_run_node <> {MARKER})"}
_WAS_PARKED = {"new": "OLD.parked", "old": f"COALESCE(OLD.last_run_node, '') = {MARKER}"}
#: the column whose update can make a row due again
_PARK_COLUMN = {"new": "parked", "old": "last_run_node"}


def _newly_due(form: str) -> str:
    return (f"{_due('NEW', _NOT_PARKED[form])} AND (OLD.status NOT IN ('CREATED', 'DELAYED', "
            f"'READY') OR OLD.trigger_time <> NEW.trigger_time OR {_WAS_PARKED[form]})")


def _pg_triggers(form: str) -> list[str]:
    """0016's two PostgreSQL triggers (the statement-level insert's function, the row-level
    update's ``WHEN``), written for ``form``."""
    return [
        f"""CREATE OR REPLACE FUNCTION ax_due_added() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ax_due (task_id, trigger_time, runner)
    SELECT task_id, trigger_time, runner FROM added AS a WHERE {_due('a', _NOT_PARKED[form])};
    RETURN NULL;
END $$""",
        f"""CREATE TRIGGER ax_due_update AFTER UPDATE ON ax_task FOR EACH ROW
    WHEN ({_newly_due(form)}) EXECUTE FUNCTION ax_due_moved()""",
    ]


_SQLITE_ADD = ("UPDATE ax_armed SET n = n + 1; "
               "INSERT INTO ax_due (task_id, trigger_time, runner, armed) "
               "SELECT NEW.task_id, NEW.trigger_time, NEW.runner, n FROM ax_armed WHERE {when};")


def _sqlite_triggers(form: str) -> list[str]:
    """0018's two SQLite triggers, written for ``form``."""
    update = f"AFTER UPDATE OF status, trigger_time, {_PARK_COLUMN[form]} ON ax_task"
    events = {"ax_task_arm_insert": ("AFTER INSERT ON ax_task", _due("NEW", _NOT_PARKED[form])),
              "ax_task_arm_update": (update, _newly_due(form))}
    return [f"CREATE TRIGGER {name} {event} WHEN NEW.{CLAIMABLE} BEGIN "
            f"{_SQLITE_ADD.format(when=when)} END" for name, (event, when) in events.items()]


def _drop_triggers(postgres: bool) -> None:
    names = (["ax_due_update ON ax_task"] if postgres
             else ["ax_task_arm_insert", "ax_task_arm_update"])
    for name in names:
        op.execute(f"DROP TRIGGER IF EXISTS {name}")


def _make_triggers(postgres: bool, form: str) -> None:
    for statement in _pg_triggers(form) if postgres else _sqlite_triggers(form):
        op.execute(statement)


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    _drop_triggers(postgres)
    for table in _TABLES:
        op.add_column(table, sa.Column("owner_node", sa.String(128)))
        op.add_column(table, sa.Column("parked", sa.Boolean(), nullable=False,
                                       server_default=sa.text("false")))
        op.execute(f"UPDATE {table} SET parked = true WHERE last_run_node = {MARKER}")
        op.execute(f"UPDATE {table} SET owner_node = last_run_node "
                   f"WHERE last_run_node IS NOT NULL AND last_run_node <> {MARKER}")
        op.drop_column(table, "last_run_node")
    _make_triggers(postgres, "new")


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    _drop_triggers(postgres)
    for table in _TABLES:
        op.add_column(table, sa.Column("last_run_node", sa.String(128)))
        op.execute(f"UPDATE {table} SET last_run_node = CASE WHEN parked THEN {MARKER} "
                   "ELSE owner_node END WHERE parked OR owner_node IS NOT NULL")
        op.drop_column(table, "parked")
        op.drop_column(table, "owner_node")
    _make_triggers(postgres, "old")
