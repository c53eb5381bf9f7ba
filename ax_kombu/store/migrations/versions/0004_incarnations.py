"""Node incarnations and bounded re-dispatch.

* ``ax_node.incarnation``: a node's name (``-n``) is stable; every process
  start registers a new incarnation under it. A heartbeat is a
  compare-and-set on the live incarnation, so a process that was declared
  dead (or replaced) learns it from its next beat.
* ``ax_task.redispatches``: how often the ack timeout sent a task out again
  because no worker started it; past ``AX_MAX_DISPATCHES`` it fails instead.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a plain ADD COLUMN on both databases (no table copy on SQLite)
    op.add_column("ax_node", sa.Column("incarnation", sa.BigInteger, nullable=False,
                                       server_default="0"))
    op.add_column("ax_task", sa.Column("redispatches", sa.Integer, nullable=False,
                                       server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("ax_task") as batch:
        batch.drop_column("redispatches")
    with op.batch_alter_table("ax_node") as batch:
        batch.drop_column("incarnation")
