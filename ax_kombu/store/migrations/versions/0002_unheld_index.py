"""A partial index over unheld DELAYED/READY tasks, for the scheduler's adoption scan.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_WHERE = "last_run_node IS NULL AND status IN ('DELAYED', 'READY')"


def upgrade() -> None:
    op.create_index("ix_ax_task_unheld", "ax_task", ["trigger_time"],
                    postgresql_where=sa.text(_WHERE), sqlite_where=sa.text(_WHERE))


def downgrade() -> None:
    op.drop_index("ix_ax_task_unheld", table_name="ax_task")
