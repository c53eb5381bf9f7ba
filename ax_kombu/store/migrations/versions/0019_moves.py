"""Tasks that move with the business: a key given up, and a record of each move.

* ``ax_task.released_key`` (and ``ax_task_archive``'s): the ``biz_key`` a finished task
  held until a later ``enqueue(..., unique="pending")`` took the key over. The key moves
  out of ``biz_key`` (so the unique ``(task_type, biz_key)`` index, unchanged, holds it for
  the new task) into this column, which no index covers: ``ax list --biz-key`` still finds
  the earlier task. A nullable ``ADD COLUMN``: no table rewrite on either database.
* ``ax_move``: one row per move of a pending task (``reschedule``, ``run_now``, an enqueue
  with ``on_conflict="replace"``): when, from which trigger time to which, and the task's
  attempt at the time. Written in the transaction that moves the task, so a move is
  recorded exactly when it happened. Index: ``(task_id)`` — a task's history
  (``ax inspect``). Archive and purge delete a task's moves with it.

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("ax_task", "ax_task_archive"):
        op.add_column(table, sa.Column("released_key", sa.String(255)))
    op.create_table(
        "ax_move",
        sa.Column("task_id", sa.BigInteger, nullable=False),
        sa.Column("moved_at", sa.BigInteger, nullable=False),
        sa.Column("from_time", sa.BigInteger, nullable=False),
        sa.Column("to_time", sa.BigInteger, nullable=False),
        sa.Column("kind", sa.String(12), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
    )
    op.create_index("ix_ax_move_task", "ax_move", ["task_id"])


def downgrade() -> None:
    op.drop_index("ix_ax_move_task", "ax_move")
    op.drop_table("ax_move")
    for table in ("ax_task_archive", "ax_task"):
        # a plain DROP COLUMN (SQLite >= 3.35): a batch copy of ax_task would lose its triggers
        op.drop_column(table, "released_key")
