"""``ax_task.armed`` is no longer kept: its index, and what stamped it, go.

Why: since 0016 the scheduler's preload asks ``ax_due`` what became due since its last round
(``ax_due.armed``, stamped by 0016's triggers). Nothing in ax reads ``ax_task.armed`` any
more, yet every claimable row version still paid for it: an entry in ``ix_ax_task_armed``
for each task enqueued and each retry, requeue or wake, a ``BEFORE UPDATE`` trigger on
PostgreSQL, and on SQLite a second write of every task inserted (its stamp). Measured by
``python -m bench.scatter_cost`` (the index taken away on the same tables; docs/benchmarks.md,
"Issue 24"): about 0.7 µs less PostgreSQL CPU per enqueued task at 10k rows (6 %; within
the noise at 10M); on SQLite, ``enqueue_many`` 11,800 → 13,600 tasks/s (``python -m
bench.revision_ab``).

* **PostgreSQL**: drops ``ix_ax_task_armed``, the trigger ``ax_task_arm`` and its function,
  and the column's default.
* **SQLite**: drops the index and remakes 0016's two triggers without the stamp: they still
  take the next value of the counter (``ax_armed``) and add the ``ax_due`` entry under it.

The column stays (NULL in new rows): ``ax_task_archive`` keeps its copy and nothing is
rewritten. A scheduler of a release before 0016 read ``ax_task.armed`` for what changed
inside the window it had read: upgrade such schedulers (or stop them) before this migration,
or a retry or requeue due inside their window waits for their recovery scan
(docs/deploy.md). The downgrade restores the index, the trigger and the default; rows
written meanwhile keep a NULL stamp, which no release since 0016 reads.

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

CLAIMABLE = "status IN ('CREATED', 'DELAYED', 'READY')"
INDEX = "ix_ax_task_armed"

_PG_UP = ["DROP TRIGGER IF EXISTS ax_task_arm ON ax_task",
          "DROP FUNCTION IF EXISTS ax_task_arm()",
          "ALTER TABLE ax_task ALTER COLUMN armed DROP DEFAULT"]
_PG_DOWN = [
    "ALTER TABLE ax_task ALTER COLUMN armed SET DEFAULT (pg_current_xact_id()::text::bigint)",
    """CREATE FUNCTION ax_task_arm() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.armed := pg_current_xact_id()::text::bigint;
    RETURN NEW;
END $$""",
    f"""CREATE TRIGGER ax_task_arm BEFORE UPDATE ON ax_task FOR EACH ROW
    WHEN (NEW.{CLAIMABLE}) EXECUTE FUNCTION ax_task_arm()""",
]

# SQLite: 0016's triggers as they were, with or without the stamp of ax_task.armed
_DUE = f"NEW.{CLAIMABLE} AND (NEW.last_run_node IS NULL OR NEW.last_run_node <> '~parked')"
_NEWLY_DUE = (f"{_DUE} AND (OLD.status NOT IN ('CREATED', 'DELAYED', 'READY') "
              "OR OLD.trigger_time <> NEW.trigger_time "
              "OR COALESCE(OLD.last_run_node, '') = '~parked')")
_COUNT = "UPDATE ax_armed SET n = n + 1; "
_STAMP = "UPDATE ax_task SET armed = (SELECT n FROM ax_armed) WHERE task_id = NEW.task_id; "
_ADD = ("INSERT INTO ax_due (task_id, trigger_time, runner, armed) "
        "SELECT NEW.task_id, NEW.trigger_time, NEW.runner, n FROM ax_armed WHERE {when};")
_SQLITE_TRIGGERS = {
    "ax_task_arm_insert": ("AFTER INSERT ON ax_task", _DUE),
    "ax_task_arm_update": ("AFTER UPDATE OF status, trigger_time, last_run_node ON ax_task",
                           _NEWLY_DUE),
}


def _sqlite_triggers(stamp: bool) -> list[str]:
    out = []
    for name, (event, when) in _SQLITE_TRIGGERS.items():
        body = _COUNT + (_STAMP if stamp else "") + _ADD.format(when=when)
        out += [f"DROP TRIGGER IF EXISTS {name}",
                f"CREATE TRIGGER {name} {event} WHEN NEW.{CLAIMABLE} BEGIN {body} END"]
    return out


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    op.drop_index(INDEX, table_name="ax_task")
    for statement in _PG_UP if postgres else _sqlite_triggers(stamp=False):
        op.execute(statement)


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    for statement in _PG_DOWN if postgres else _sqlite_triggers(stamp=True):
        op.execute(statement)
    op.create_index(INDEX, "ax_task", ["armed"], postgresql_where=sa.text(CLAIMABLE))
