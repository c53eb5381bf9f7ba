"""Alert notifications survive a scheduler's death (issue 40): ``ax_alert``'s outbox.

* ``outbox``: the alert's messages not yet delivered, a JSON list of ``{id, kind, body,
  at}`` (NULL or ``[]``: none). The compare-and-set that opens or closes an incident
  appends its message in the same statement; a delivered message is taken out by another
  compare-and-set (:mod:`ax_kombu.alerts.evaluator`).
* ``outbox_claimed_until``: the takeover time (epoch ms): until then the scheduler
  delivering the messages has them alone; past it, any scheduler's pass takes them over.

Two nullable ``ADD COLUMN``: no rewrite.

Revision ID: 0026
Revises: 0025
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ax_alert", sa.Column("outbox", sa.Text))
    op.add_column("ax_alert", sa.Column("outbox_claimed_until", sa.BigInteger))


def downgrade() -> None:
    # a plain DROP COLUMN (SQLite >= 3.35); undelivered messages are lost
    op.drop_column("ax_alert", "outbox_claimed_until")
    op.drop_column("ax_alert", "outbox")
