"""A worker's held runs: ``ax_node.held_runs``.

A worker fences its runs RUNNING in batches ahead of its threads, so a RUNNING row
did not say whether its run had started. A worker killed while it only held a staged run
had that run recovered as "worker lost": a retry counted, or FAILED with
``max_retry = 0``, for a run that never happened. The worker now writes which of its
RUNNING tasks it holds and will not start before a later write (``,id,id,``;
:mod:`ax_kombu.worker.holds`); the recovery gives those a new attempt without counting a
retry. NULL or an id not listed counts as started, as before.

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
    op.add_column("ax_node", sa.Column("held_runs", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ax_node") as batch:
        batch.drop_column("held_runs")
