"""Attempt history and results.

* ``ax_attempt``: one row per ended attempt (who ran it, when, how it ended, how
  long), written when the attempt ends.
* ``ax_task.result``: the processor's return value (JSON), for SUCCESS.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ax_task", sa.Column("result", sa.Text))
    op.create_table(
        "ax_attempt",
        sa.Column("task_id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("attempt", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("task_type", sa.String(128), nullable=False),
        sa.Column("node", sa.String(128)),
        sa.Column("trigger_time", sa.BigInteger, nullable=False),
        sa.Column("dispatched_at", sa.BigInteger),
        sa.Column("started_at", sa.BigInteger),
        sa.Column("finished_at", sa.BigInteger, nullable=False),
        sa.Column("outcome", sa.String(12), nullable=False),
        sa.Column("error", sa.Text),
        sa.Column("duration_ms", sa.BigInteger),
    )
    op.create_index("ix_ax_attempt_type_finished", "ax_attempt", ["task_type", "finished_at"])


def downgrade() -> None:
    op.drop_index("ix_ax_attempt_type_finished", table_name="ax_attempt")
    op.drop_table("ax_attempt")
    with op.batch_alter_table("ax_task") as batch:
        batch.drop_column("result")
