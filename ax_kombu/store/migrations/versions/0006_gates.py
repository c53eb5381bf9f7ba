"""Ordered keys, cluster-wide limits, job strategies and shards.

* ``ax_task.order_key`` / ``order_seq``: one task at a time per key, in order;
  a partial index over tasks that have a key.
* ``ax_task.gate``: what the claim checks first ('order', 'order_skip',
  'discard', 'cover'); ``ax_task.gated``: claimed by the gated claim.
* ``ax_task.shard_index`` / ``shard_total``: the shards of one enqueue;
  ``target_node``: the worker a ``shards="workers"`` shard is sent to.
* ``ax_job.strategy``: parallel, serial, cover or discard.
* ``ax_limit``: at most N tasks of a type DISPATCHING or RUNNING at once.

All nullable (or defaulted) ``ADD COLUMN``s: no table rewrite.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_ORDERED = sa.text("order_key IS NOT NULL")


def upgrade() -> None:
    op.add_column("ax_task", sa.Column("order_key", sa.String(255)))
    op.add_column("ax_task", sa.Column("order_seq", sa.BigInteger))
    op.add_column("ax_task", sa.Column("gate", sa.String(12)))
    op.add_column("ax_task", sa.Column("gated", sa.Boolean, nullable=False,
                                       server_default=sa.text("false")))
    op.add_column("ax_task", sa.Column("shard_index", sa.Integer))
    op.add_column("ax_task", sa.Column("shard_total", sa.Integer))
    op.add_column("ax_task", sa.Column("target_node", sa.String(128)))
    op.create_index("ix_ax_task_order", "ax_task", ["order_key", "order_seq", "task_id"],
                    postgresql_where=_ORDERED, sqlite_where=_ORDERED)
    op.add_column("ax_job", sa.Column("strategy", sa.String(12), nullable=False,
                                      server_default="parallel"))
    op.create_table(
        "ax_limit",
        sa.Column("task_type", sa.String(128), primary_key=True),
        sa.Column("max_running", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.BigInteger, nullable=False),
        sa.CheckConstraint("max_running >= 1", name="ck_ax_limit_positive"),
    )


def downgrade() -> None:
    op.drop_table("ax_limit")
    with op.batch_alter_table("ax_job") as batch:
        batch.drop_column("strategy")
    op.drop_index("ix_ax_task_order", table_name="ax_task")
    with op.batch_alter_table("ax_task") as batch:
        for column in ("target_node", "shard_total", "shard_index", "gated", "gate",
                       "order_seq", "order_key"):
            batch.drop_column(column)
