"""Paused task types and queues, and quiet workers (issue 40).

* ``ax_pause``: one row per paused task type (``kind`` ``type``) or queue (``kind``
  ``queue``, the priority's queue name), cluster-wide: the schedulers leave its tasks
  unclaimed, waiting and visibly late, until the row is deleted (resume). ``paused_at``
  epoch ms, ``actor`` who paused it. Primary key ``(kind, name)``: a pause is set once; the
  table holds a handful of rows, read whole by each scheduler.
* ``ax_node.quiet_at``: an operator asked this worker to be quiet (``ax workers quiet``)
  at that time (epoch ms; NULL: not asked, or resumed). A quiet worker starts nothing new:
  it finishes what runs and hands its staged runs back. Nullable ``ADD COLUMN``: no rewrite.

Revision ID: 0025
Revises: 0024
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ax_pause",
        sa.Column("kind", sa.String(8), primary_key=True),
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("paused_at", sa.BigInteger, nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.CheckConstraint("kind IN ('type', 'queue')", name="ck_ax_pause_kind"),
    )
    op.add_column("ax_node", sa.Column("quiet_at", sa.BigInteger))


def downgrade() -> None:
    # a plain DROP COLUMN (SQLite >= 3.35)
    op.drop_column("ax_node", "quiet_at")
    op.drop_table("ax_pause")
