"""Per-type alerts (issue 40): ``ax_alert``, one row per alerted task type.

What it watches (``on_failed``; ``on_late`` with ``late_after_ms``), where it sends
(``webhook``, signed per Standard Webhooks with ``secret``), and its incident state, which
the schedulers' evaluators move by compare-and-set on ``checked_until``
(:mod:`ax_kombu.alerts.evaluator`): ``opened_at`` (NULL: no incident open),
``last_event_at``, ``events``, ``sample_task_id``. No index beyond the primary key: the
table holds one row per alerted type.

Revision ID: 0024
Revises: 0023
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ax_alert",
        sa.Column("task_type", sa.String(128), primary_key=True),
        sa.Column("on_failed", sa.Boolean, nullable=False),
        sa.Column("on_late", sa.Boolean, nullable=False),
        sa.Column("late_after_ms", sa.BigInteger),
        sa.Column("webhook", sa.String(2048), nullable=False),
        sa.Column("secret", sa.String(128), nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.BigInteger, nullable=False),
        sa.Column("checked_until", sa.BigInteger, nullable=False),
        sa.Column("opened_at", sa.BigInteger),
        sa.Column("last_event_at", sa.BigInteger),
        sa.Column("events", sa.Integer, nullable=False, server_default="0"),
        sa.Column("sample_task_id", sa.BigInteger),
        sa.CheckConstraint("on_failed OR on_late", name="ck_ax_alert_watches"),
        sa.CheckConstraint("NOT on_late OR late_after_ms > 0", name="ck_ax_alert_late_after"),
    )


def downgrade() -> None:
    op.drop_table("ax_alert")
