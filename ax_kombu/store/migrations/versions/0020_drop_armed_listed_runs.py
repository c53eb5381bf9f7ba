"""``ax_task.armed`` goes, and ``ax_node.held_runs`` becomes ``listed_runs``.

* ``ax_task.armed`` (and ``ax_task_archive``'s copy): written by no release since 0018,
  read by none since 0016 (the preload asks ``ax_due.armed``). A plain ``DROP COLUMN``:
  on PostgreSQL a catalog change, no rewrite; on SQLite (3.35 or later) the table's
  definition is edited in place, its triggers kept (0018's triggers stamp ``ax_due``, not
  this column).
* ``ax_node.held_runs`` → ``listed_runs``: the runs a worker has written down as staged and
  not started (:mod:`ax_kombu.store.recovery` gives each a new attempt without counting a
  retry). Only the name changes, to the glossary's word (a *listed run*).

Stop the workers and schedulers of an earlier release before this migration: they write
and read ``held_runs`` by its old name. The downgrade adds ``armed`` back (NULL, as 0018
left new rows) and gives ``listed_runs`` its old name.

Revision ID: 0020
Revises: 0019
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_TABLES = ("ax_task", "ax_task_archive")


# (a plain RENAME COLUMN, which both databases know: SQLite since 3.25)


def upgrade() -> None:
    for table in _TABLES:
        op.drop_column(table, "armed")
    op.execute("ALTER TABLE ax_node RENAME COLUMN held_runs TO listed_runs")


def downgrade() -> None:
    op.execute("ALTER TABLE ax_node RENAME COLUMN listed_runs TO held_runs")
    for table in _TABLES:
        op.add_column(table, sa.Column("armed", sa.BigInteger()))
