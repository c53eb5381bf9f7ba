"""The duplicate check's fingerprints move out of ``ax_task`` into ``ax_fingerprint``.

``ix_ax_task_fingerprint`` was an index of ``ax_task``: every version of a task (insert,
claim, RUNNING, final) wrote an entry there, though only the enqueue ever asks for it. It
was the largest index entry a version wrote (a 32-character key), and dropping it cut
PostgreSQL's CPU per task from 61 to 46 µs and the WAL from 2,412 to 1,917 bytes
(``python -m bench.pgcost --variants base,nofp``, docs/benchmarks.md). Now the enqueue
writes one ``(fingerprint, trigger_time, task_id)`` row beside each task and nothing
updates it; the check joins it to ``ax_task``, so a cancelled, archived or purged task is
no duplicate, as before.

The existing tasks' pairs are copied over (one ``INSERT … SELECT``; on a large table it
runs as long as reading it once).

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ax_fingerprint",
        sa.Column("fingerprint", sa.String(32), nullable=False),
        sa.Column("trigger_time", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("task_id", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.PrimaryKeyConstraint("fingerprint", "trigger_time", "task_id"),
    )
    op.execute("INSERT INTO ax_fingerprint (fingerprint, trigger_time, task_id) "
               "SELECT fingerprint, trigger_time, task_id FROM ax_task")
    op.drop_index("ix_ax_task_fingerprint", table_name="ax_task")


def downgrade() -> None:
    op.create_index("ix_ax_task_fingerprint", "ax_task", ["fingerprint", "trigger_time"])
    op.drop_table("ax_fingerprint")
