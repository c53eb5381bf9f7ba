"""``ax_fingerprint``'s key becomes a hash index on the fingerprint (PostgreSQL).

The duplicate check looks every new task's fingerprint up and then adds it: two probes of
the key per task. As a B-tree over (fingerprint, trigger_time, task_id) each probe descended
to a random leaf of a tree that grows with the day's enqueues. At 1.2M entries (what a
10,000,000-row table keeps, ``python -m bench.bigtable``) the lookup of a batch of 1,000 took
7.8 ms (3,003 buffers) against 0.3 ms at 1,000 entries, and through a hash index 4.0 ms
(1,047 buffers): one bucket page per probe whatever the size. (A table of 1.18M md5 keys
alone: lookups of 1,000 8.8 → 3.1 ms, inserts 9.8 → 3.9 ms; 2.0 and 2.9 ms at 2,000
entries.) The check only ever asks
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
