"""Python-native runs: a task's W3C trace context, and each run's own log lines.

* ``ax_task.traceparent`` and ``ax_task.tracestate`` (and ``ax_task_archive``'s): the
  OpenTelemetry context current when the task was enqueued (W3C Trace Context headers,
  ``traceparent`` 55 characters, ``tracestate`` at most 512), carried into the message
  headers so the worker's run span is its child. NULL: enqueued without a trace. Nullable
  ``ADD COLUMN``: no table rewrite on either database.
* ``ax_run_log`` (and ``ax_run_log_archive``): the log lines one run emitted (its thread's
  or its coroutine's ``logging`` records, and ``ctx.log``), bounded by the worker; ``lines``
  is a JSON list, ``cut`` says what was left out (NULL: nothing). One row per (task,
  attempt) that logged anything, written in the transaction that records the run's end.
  Archive and purge move or delete a task's log rows with it.

Revision ID: 0022
Revises: 0021
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

_LOG_TABLES = ("ax_run_log", "ax_run_log_archive")


def upgrade() -> None:
    for table in ("ax_task", "ax_task_archive"):
        op.add_column(table, sa.Column("traceparent", sa.String(55)))
        op.add_column(table, sa.Column("tracestate", sa.String(512)))
    for name in _LOG_TABLES:
        op.create_table(
            name,
            sa.Column("task_id", sa.BigInteger, primary_key=True, autoincrement=False),
            sa.Column("attempt", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("lines", sa.Text, nullable=False),
            sa.Column("cut", sa.Text),
            sa.Column("written_at", sa.BigInteger, nullable=False),
        )


def downgrade() -> None:
    for name in reversed(_LOG_TABLES):
        op.drop_table(name)
    for table in ("ax_task_archive", "ax_task"):
        # a plain DROP COLUMN (SQLite >= 3.35): a batch copy of ax_task would lose its triggers
        op.drop_column(table, "tracestate")
        op.drop_column(table, "traceparent")
