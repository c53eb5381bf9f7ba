"""``ax_fingerprint``'s key becomes a hash index on the fingerprint (PostgreSQL).

The duplicate check looks every new task's fingerprint up and then adds it: two probes of
the key per task. As a B-tree over (fingerprint, trigger_time, task_id) each probe descended
to a random leaf of a tree that grows with the day's enqueues: at 1.2M entries (a
10,000,000-row table, `python -m bench.bigtable`) a batch of 1,000 spent 8–9 ms looking up
and 10 ms adding, against 2 and 3 ms at 2,000 entries. A hash index finds a fingerprint's
bucket in one page whatever its size (3 and 4 ms at 1.2M entries). The check only ever asks
"this fingerprint?" and reads the trigger times of what it finds from the row, so nothing
needs the B-tree's order; the table keeps no primary key (an entry is written once, by the
enqueue of its task, and deleted by task id and fingerprint, or by the prune). SQLite keeps
its primary key: it has no hash index, and it is not the high-rate store.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

INDEX = "ix_ax_fingerprint_hash"
KEY = "ax_fingerprint_pkey"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.create_index(INDEX, "ax_fingerprint", ["fingerprint"], postgresql_using="hash")
        op.drop_constraint(KEY, "ax_fingerprint", type_="primary")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.create_primary_key(KEY, "ax_fingerprint", ["fingerprint", "trigger_time", "task_id"])
        op.drop_index(INDEX, table_name="ax_fingerprint")
