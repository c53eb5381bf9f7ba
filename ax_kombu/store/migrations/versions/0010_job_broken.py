"""A recurring job no scheduler can plan is marked, with the reason: ``ax_job.broken``.

A job row that cannot be parsed (a zone this machine's tzdata lacks, an expression or
interval written past the API) was skipped by each scheduler on every pass, logged once
per process and shown nowhere; it also stayed in the due range for ever. The
materialiser now writes why into ``broken`` and leaves the row alone until ``schedule()``
sets the job again (:mod:`ax_kombu.scheduler.recurrence`); ``ax jobs list`` shows it.

A nullable ``ADD COLUMN``: no rewrite, no backfill.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ax_job", sa.Column("broken", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ax_job") as batch:
        batch.drop_column("broken")
