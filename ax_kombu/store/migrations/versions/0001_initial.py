"""The task table, snowflake id leases and node heartbeats.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ax_task",
        sa.Column("task_id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("task_type", sa.String(128), nullable=False),
        sa.Column("trigger_time", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(12), nullable=False),
        sa.Column("priority", sa.String(8), nullable=False),
        sa.Column("retry_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_retry", sa.Integer, nullable=False),
        sa.Column("timeout_ms", sa.Integer, nullable=False),
        sa.Column("processor_name", sa.String(255)),
        sa.Column("callback_url", sa.String(2048)),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("biz_key", sa.String(255)),
        sa.Column("fingerprint", sa.String(32), nullable=False),
        sa.Column("trace_id", sa.String(32), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_run_node", sa.String(128)),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("dispatched_at", sa.BigInteger),
        sa.Column("started_at", sa.BigInteger),
        sa.Column("finished_at", sa.BigInteger),
        sa.Column("last_error", sa.Text),
        sa.UniqueConstraint("task_type", "biz_key", name="uq_ax_task_type_biz_key"),
        sa.CheckConstraint("(processor_name IS NULL) <> (callback_url IS NULL)",
                           name="ck_ax_task_one_target"),
    )
    op.create_index("ix_ax_task_status_trigger", "ax_task", ["status", "trigger_time"])
    op.create_index("ix_ax_task_type_status", "ax_task", ["task_type", "status"])
    op.create_index("ix_ax_task_fingerprint", "ax_task", ["fingerprint", "trigger_time"])
    leases = op.create_table(
        "ax_id_lease",
        sa.Column("slot", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("owner", sa.String(128)),
        sa.Column("lease_until", sa.BigInteger, nullable=False, server_default="0"),
    )
    op.bulk_insert(leases, [{"slot": s, "owner": None, "lease_until": 0} for s in range(1024)])
    op.create_table(
        "ax_node",
        sa.Column("node_id", sa.String(128), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started_at", sa.BigInteger, nullable=False),
        sa.Column("heartbeat_at", sa.BigInteger, nullable=False),
        sa.Column("stopped_at", sa.BigInteger),
        sa.Column("info", sa.Text, nullable=False, server_default="{}"),
    )


def downgrade() -> None:
    op.drop_table("ax_node")
    op.drop_table("ax_id_lease")
    op.drop_table("ax_task")
