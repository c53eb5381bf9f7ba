"""Archive tables: where ``ax archive`` and ``AX_RETENTION`` move finished tasks.

* ``ax_task_archive``: the columns of ``ax_task``, without its constraints and
  hot-path indexes; the primary key and ``(finished_at)`` (to expire the archive
  itself by age) only.
* ``ax_attempt_archive``: the columns of ``ax_attempt``; the primary key only.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ax_task_archive",
        sa.Column("task_id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("task_type", sa.String(128), nullable=False),
        sa.Column("trigger_time", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(12), nullable=False),
        sa.Column("priority", sa.String(8), nullable=False),
        sa.Column("retry_count", sa.Integer, nullable=False),
        sa.Column("max_retry", sa.Integer, nullable=False),
        sa.Column("timeout_ms", sa.Integer, nullable=False),
        sa.Column("processor_name", sa.String(255)),
        sa.Column("callback_url", sa.String(2048)),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("biz_key", sa.String(255)),
        sa.Column("fingerprint", sa.String(32), nullable=False),
        sa.Column("trace_id", sa.String(32), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("last_run_node", sa.String(128)),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("dispatched_at", sa.BigInteger),
        sa.Column("started_at", sa.BigInteger),
        sa.Column("finished_at", sa.BigInteger),
        sa.Column("last_error", sa.Text),
        sa.Column("redispatches", sa.Integer, nullable=False),
        sa.Column("job", sa.String(128)),
        sa.Column("scheduled_at", sa.BigInteger),
        sa.Column("order_key", sa.String(255)),
        sa.Column("order_seq", sa.BigInteger),
        sa.Column("gate", sa.String(12)),
        sa.Column("gated", sa.Boolean, nullable=False),
        sa.Column("shard_index", sa.Integer),
        sa.Column("shard_total", sa.Integer),
        sa.Column("target_node", sa.String(128)),
        sa.Column("result", sa.Text),
    )
    op.create_index("ix_ax_task_archive_finished", "ax_task_archive", ["finished_at"])
    op.create_table(
        "ax_attempt_archive",
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


def downgrade() -> None:
    op.drop_table("ax_attempt_archive")
    op.drop_index("ix_ax_task_archive_finished", table_name="ax_task_archive")
    op.drop_table("ax_task_archive")
