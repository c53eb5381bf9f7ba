"""A BRIN index on ``ax_fingerprint.task_id`` (PostgreSQL), for pruning old entries.

``ax_fingerprint`` kept one row per task for as long as the task stayed in ``ax_task``: a
table of millions of finished tasks kept millions of entries, and the enqueue's duplicate
check descended an ever deeper key for each new task. An entry can only matter for a
duplicate enqueued around its trigger time, and producers retry within minutes: the
schedulers now delete entries of tasks created more than ``fingerprint_retention_s`` ago
whose trigger time has passed (:func:`ax_kombu.store.tasks.prune_fingerprints`). Task ids
are snowflakes, ordered by creation time, so a BRIN index on them finds the old entries
for the cost of a few pages, and costs the enqueue almost nothing to keep. SQLite (the
embedded store) prunes by reading the table.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.create_index("ix_ax_fingerprint_task", "ax_fingerprint", ["task_id"],
                        postgresql_using="brin")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_ax_fingerprint_task", table_name="ax_fingerprint")
