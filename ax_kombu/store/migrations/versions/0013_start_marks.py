"""A worker's start marks: ``ax_node.start_marks``.

A worker fences its runs RUNNING in batches ahead of its threads, so a RUNNING row
did not say whether its run had started. A worker killed while it only held a staged run
had that run recovered as "worker lost": a retry counted, or FAILED with
``max_retry = 0``, for a run that never happened. The worker now writes which of its
RUNNING tasks may have started (``,id,id,``) before it calls their processors, in
batches ahead of its threads (:mod:`ax_kombu.worker.marks`); the recovery counts a retry
only for those. NULL (schedulers, Celery workers, rows written before this revision)
counts every RUNNING task as started, as before.

A nullable ``ADD COLUMN``: no rewrite, no backfill.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ax_node", sa.Column("start_marks", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ax_node") as batch:
        batch.drop_column("start_marks")
