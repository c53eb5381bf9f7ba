"""The preload becomes a read: ``ax_task.armed`` says which transaction last made a row
claimable, and the indexes leave finished rows out.

Before, every task was written five times on the plain path: inserted CREATED, moved to
DELAYED/READY and held by the preload, claimed, RUNNING, final. The preload's write only
said "this scheduler has it in memory". Now a task is inserted DELAYED (or READY when
already due), each scheduler reads its share of the window without writing
(:func:`ax_kombu.store.preload.preload`), and the claim's compare-and-set stays the one
arbiter: four row versions per task.

A read-only preload must still find rows that *become* claimable inside the window it has
already read (a retry, a requeue, ``ax retry``, a parked task woken, a task enqueued due
soon). So every row version that is claimable (CREATED, DELAYED or READY) carries in
``armed`` the transaction that wrote it:

* **PostgreSQL**: the writer's 64-bit transaction id (``pg_current_xact_id()``), by the
  column's default on insert and by a ``BEFORE UPDATE`` trigger on every update that leaves
  the row claimable, whoever writes it (older code included). A preload notes the snapshot
  it read under; the next one asks for rows armed by a transaction that snapshot could not
  see (an id at or past its ``xmax``, or one of its in-progress ids), so a transaction that
  commits late is never skipped.
* **SQLite**: one writer at a time, so a counter (``ax_armed``, one row) is enough; triggers
  set it on insert and on each update that leaves a row claimable.

Indexes: ``ix_ax_task_armed`` over claimable rows (one entry per task on the plain path);
``ix_ax_task_unheld`` goes (nothing holds a row any more). On PostgreSQL the status
indexes split the states between them, so each of a task's four versions writes one
entry, not two: ``ix_ax_task_status_trigger`` covers the waiting and the finished states
(the preload, the overdue probe, the history by trigger time) and ``ix_ax_task_type_status``
the in-flight ones, DISPATCHING and RUNNING (the cluster-wide limits; the ack-timeout and
dead-worker scans read it whole, as many entries as tasks in flight). SQLite keeps full
indexes: it uses a partial one only for a query that repeats its ``WHERE`` terms.

``ax_task`` gets a fillfactor of 70 on PostgreSQL: a task's next version then usually lands
on its own page, which PostgreSQL logs as the bytes that changed rather than the whole row
(measured: docs/benchmarks.md, "PostgreSQL cost per task").

No table rewrite: the column is added without a default, which is set afterwards for new
rows only; existing claimable rows are found by the preload's first full read of its
window.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

CLAIMABLE = "status IN ('CREATED', 'DELAYED', 'READY')"
WAITING_OR_DONE = ("status IN ('CREATED', 'DELAYED', 'READY', 'SUCCESS', 'FAILED', "
                   "'CANCELLED')")
BUSY = "status IN ('DISPATCHING', 'RUNNING')"
_UNHELD = "last_run_node IS NULL AND status IN ('DELAYED', 'READY')"

#: free room on each page of ax_task, so that a row's next versions can land beside it
FILLFACTOR = 70

_PG_UP = [
    f"ALTER TABLE ax_task SET (fillfactor = {FILLFACTOR})",
    "ALTER TABLE ax_task ALTER COLUMN armed SET DEFAULT (pg_current_xact_id()::text::bigint)",
    """CREATE FUNCTION ax_task_arm() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.armed := pg_current_xact_id()::text::bigint;
    RETURN NEW;
END $$""",
    f"""CREATE TRIGGER ax_task_arm BEFORE UPDATE ON ax_task FOR EACH ROW
    WHEN (NEW.{CLAIMABLE}) EXECUTE FUNCTION ax_task_arm()""",
]
_PG_DOWN = ["ALTER TABLE ax_task RESET (fillfactor)",
            "DROP TRIGGER IF EXISTS ax_task_arm ON ax_task",
            "DROP FUNCTION IF EXISTS ax_task_arm()"]

_SQLITE_ARM = ("UPDATE ax_armed SET n = n + 1; "
               "UPDATE ax_task SET armed = (SELECT n FROM ax_armed) "
               "WHERE task_id = NEW.task_id;")
_SQLITE_UP = [
    "CREATE TABLE ax_armed (n BIGINT NOT NULL)",
    "INSERT INTO ax_armed (n) VALUES (0)",
    f"""CREATE TRIGGER ax_task_arm_insert AFTER INSERT ON ax_task
    WHEN NEW.{CLAIMABLE} BEGIN {_SQLITE_ARM} END""",
    f"""CREATE TRIGGER ax_task_arm_update AFTER UPDATE OF status, trigger_time, last_run_node
    ON ax_task WHEN NEW.{CLAIMABLE} BEGIN {_SQLITE_ARM} END""",
]
_SQLITE_DOWN = ["DROP TRIGGER IF EXISTS ax_task_arm_update",
                "DROP TRIGGER IF EXISTS ax_task_arm_insert", "DROP TABLE IF EXISTS ax_armed"]


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    op.add_column("ax_task", sa.Column("armed", sa.BigInteger(), nullable=True))
    op.add_column("ax_task_archive", sa.Column("armed", sa.BigInteger(), nullable=True))
    for statement in _PG_UP if postgres else _SQLITE_UP:
        op.execute(statement)
    op.create_index("ix_ax_task_armed", "ax_task", ["armed"], postgresql_where=sa.text(CLAIMABLE))
    op.drop_index("ix_ax_task_unheld", table_name="ax_task")
    op.drop_index("ix_ax_task_status_trigger", table_name="ax_task")
    op.create_index("ix_ax_task_status_trigger", "ax_task", ["status", "trigger_time"],
                    postgresql_where=sa.text(WAITING_OR_DONE))
    op.drop_index("ix_ax_task_type_status", table_name="ax_task")
    op.create_index("ix_ax_task_type_status", "ax_task", ["task_type", "status"],
                    postgresql_where=sa.text(BUSY))


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    op.drop_index("ix_ax_task_type_status", table_name="ax_task")
    op.create_index("ix_ax_task_type_status", "ax_task", ["task_type", "status"])
    op.drop_index("ix_ax_task_status_trigger", table_name="ax_task")
    op.create_index("ix_ax_task_status_trigger", "ax_task", ["status", "trigger_time"])
    op.create_index("ix_ax_task_unheld", "ax_task", ["trigger_time"],
                    postgresql_where=sa.text(_UNHELD), sqlite_where=sa.text(_UNHELD))
    op.drop_index("ix_ax_task_armed", table_name="ax_task")
    for statement in _PG_DOWN if postgres else _SQLITE_DOWN:
        op.execute(statement)
    with op.batch_alter_table("ax_task_archive") as batch:
        batch.drop_column("armed")
    with op.batch_alter_table("ax_task") as batch:
        batch.drop_column("armed")
