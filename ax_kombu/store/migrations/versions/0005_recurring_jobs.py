"""Recurring jobs: the ``ax_job`` table, and which occurrence of which job a task is.

* ``ax_job``: one row per job (cron or interval, time zone, misfire policy,
  the task template, paused, the first occurrence not yet written).
* ``ax_task.job`` / ``ax_task.scheduled_at`` with a partial unique index over
  ``(job, scheduled_at)``: two schedulers writing the same occurrence create
  one task. Both are plain nullable ``ADD COLUMN``s (no table rewrite on
  PostgreSQL, no copy on SQLite); one-off tasks write no entry in the index.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_OCCURRENCE = sa.text("job IS NOT NULL")
_ACTIVE_JOB = sa.text("NOT paused AND next_fire_at IS NOT NULL")


def upgrade() -> None:
    op.add_column("ax_task", sa.Column("job", sa.String(128)))
    op.add_column("ax_task", sa.Column("scheduled_at", sa.BigInteger))
    op.create_index("uq_ax_task_occurrence", "ax_task", ["job", "scheduled_at"], unique=True,
                    postgresql_where=_OCCURRENCE, sqlite_where=_OCCURRENCE)
    op.create_table(
        "ax_job",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("task_type", sa.String(128), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("cron", sa.String(256)),
        sa.Column("every_ms", sa.BigInteger),
        sa.Column("tz", sa.String(64), nullable=False),
        sa.Column("misfire", sa.String(12), nullable=False),
        sa.Column("misfire_grace_ms", sa.BigInteger),
        sa.Column("priority", sa.String(8), nullable=False),
        sa.Column("max_retry", sa.Integer, nullable=False),
        sa.Column("timeout_ms", sa.Integer, nullable=False),
        sa.Column("processor_name", sa.String(255)),
        sa.Column("callback_url", sa.String(2048)),
        sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.Column("anchor_ms", sa.BigInteger, nullable=False),
        sa.Column("next_fire_at", sa.BigInteger),
        sa.Column("spec", sa.String(32), nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.BigInteger, nullable=False),
        sa.CheckConstraint("(cron IS NULL) <> (every_ms IS NULL)", name="ck_ax_job_one_schedule"),
        sa.CheckConstraint("(processor_name IS NULL) <> (callback_url IS NULL)",
                           name="ck_ax_job_one_target"),
    )
    op.create_index("ix_ax_job_due", "ax_job", ["next_fire_at"],
                    postgresql_where=_ACTIVE_JOB, sqlite_where=_ACTIVE_JOB)


def downgrade() -> None:
    op.drop_index("ix_ax_job_due", table_name="ax_job")
    op.drop_table("ax_job")
    op.drop_index("uq_ax_task_occurrence", table_name="ax_task")
    with op.batch_alter_table("ax_task") as batch:
        batch.drop_column("scheduled_at")
        batch.drop_column("job")
