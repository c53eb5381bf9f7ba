"""``ax_fingerprint`` is found by a *probe* that puts entries due close together side by
side (PostgreSQL): a B-tree on ``((trigger_time >> 20) << 32) | first 32 bits of the
fingerprint`` replaces 0015's hash index on the fingerprint.

Why: the duplicate check looks each new task's fingerprint up, then adds its entry. Through
the hash index each of those touched one page chosen at random among all of the index's
pages, so with 1.2M entries (a 10,000,000-row ``ax_task``: ``python -m bench.bigtable``) a
batch of 1,000 touched 1,047 pages for its lookup and a thousand more for its adds, against
22 in all at 10,000 rows; the lookup took 4.5 ms against 0.3 ms, and PostgreSQL's CPU per
enqueued task was 1.47 times that of the small table. A batch is due within minutes of
itself (tasks are enqueued for a time, and many for the same time): by the probe its lookups
and adds land on the few leaf pages of those minutes' entries, whatever the table's size.
The probe is a hash: the check still compares the fingerprint and trigger time of what it
finds (:func:`ax_kombu.store.tasks.probes`, which also names the buckets a dedup window
touches). SQLite keeps its primary key. Measured (``python -m bench.dedup_index``, the two
indexes in turn on the same tables): a batch due together costs PostgreSQL about the same
CPU at 10k rows and 15–17 % less at 10M, where its lookup fell from 4.3–4.8 to 1.1–1.6 ms;
a batch whose tasks are due at scattered times over days costs 3–18 % more at 10M (no
locality for either index to use).

Building the index holds the table (inserts wait: about a second per million entries);
``ANALYZE`` then gives the planner the expression's statistics, without which it would
estimate a thousand probes to match most of the table. A producer of the previous release
still running looks fingerprints up by value, which no index serves any more: its batches
read ``ax_fingerprint`` whole until it is upgraded (docs/deploy.md).

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

INDEX = "ix_ax_fingerprint_probe"
HASH = "ix_ax_fingerprint_hash"
PROBE = "(((trigger_time >> 20) << 32) | ('x' || left(fingerprint, 8))::bit(32)::bigint)"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"CREATE INDEX {INDEX} ON ax_fingerprint (({PROBE}))")
        op.drop_index(HASH, table_name="ax_fingerprint")
        op.execute("ANALYZE ax_fingerprint")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.create_index(HASH, "ax_fingerprint", ["fingerprint"], postgresql_using="hash")
        op.drop_index(INDEX, table_name="ax_fingerprint")
