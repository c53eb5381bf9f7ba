"""The (task_type, biz_key) uniqueness as a partial index over tasks that have a biz_key.

Every status change of a task is a new row version with a new entry in each
of its indexes. Most tasks have no biz_key, and their entries in the old
unique constraint only cost write time: PostgreSQL now indexes only the rows
that have one (NULL biz_keys never conflicted). SQLite keeps its constraint:
dropping one there means copying the table, its unique constraint already
lets NULLs repeat, and it is not the high-rate store.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

NAME = "uq_ax_task_type_biz_key"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.drop_constraint(NAME, "ax_task", type_="unique")
    op.create_index(NAME, "ax_task", ["task_type", "biz_key"], unique=True,
                    postgresql_where=sa.text("biz_key IS NOT NULL"))


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.drop_index(NAME, table_name="ax_task")
    op.create_unique_constraint(NAME, "ax_task", ["task_type", "biz_key"])
