"""Where a task runs, stored: ``ax_task.runner`` (and ``ax_task_archive.runner``).

* ``'ax'``: an ax worker runs its processor (``processor_name``);
* ``'callback'``: an ax worker calls its ``callback_url``;
* ``'celery'``: a stock Celery worker runs it (the scheduler records the hand-off);
* ``'celery_ax'``: a Celery worker with :class:`ax_kombu.celery.AxBootstep` runs it
  (the worker fences and records the run).

Until now the route was read from ``processor_name`` by string match (``celery:`` /
``celery+ax:``); existing rows are backfilled by that rule, once, here. From now on only
:mod:`ax_kombu.celery` sets a Celery runner, and the claim, preload and recovery read the
column (:mod:`ax_kombu.store.claims`).

A defaulted ``ADD COLUMN`` (no table rewrite on PostgreSQL 11+); the backfill touches the
callback and Celery rows only.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

#: today's prefix rule, for the rows written before the column existed
_BACKFILL = """
    UPDATE {table}
       SET runner = CASE WHEN callback_url IS NOT NULL THEN 'callback'
                         WHEN processor_name LIKE 'celery+ax:%' THEN 'celery_ax'
                         ELSE 'celery' END
     WHERE callback_url IS NOT NULL
        OR processor_name LIKE 'celery:%' OR processor_name LIKE 'celery+ax:%'"""


def upgrade() -> None:
    for table in ("ax_task", "ax_task_archive"):
        op.add_column(table, sa.Column("runner", sa.String(12), nullable=False,
                                       server_default="ax"))
        op.execute(sa.text(_BACKFILL.format(table=table)))


def downgrade() -> None:
    for table in ("ax_task_archive", "ax_task"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("runner")
