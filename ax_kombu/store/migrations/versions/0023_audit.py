"""A record of operator actions (issue 40): who changed what, when.

* ``ax_audit``: one row per state-changing action of the console, the CLI or the client
  (cancel, retry, reschedule, run now, purge, archive, pause, limits, jobs, alerts, users):
  ``at`` epoch ms (the database clock), ``actor`` (a console user, the trusted proxy's
  user, ``token`` for the shared console token, the OS user or ``--as`` on the CLI),
  ``via`` (``console``, ``cli``, ``api``), ``action``, ``target`` (what it acted on, e.g.
  ``task 123``, ``type sms.send``), ``detail`` (JSON text, NULL: none). Index ``(at)``:
  ``ax audit --since`` and the retention both ask by time.
* ``ax_audit_archive``: the same columns; old records move there with the archive rules.

Revision ID: 0023
Revises: 0022
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def _columns() -> list[sa.Column[object]]:
    return [
        # BIGINT on PostgreSQL; SQLite's autoincrement needs an INTEGER primary key
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True),
        sa.Column("at", sa.BigInteger, nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("via", sa.String(16), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target", sa.String(256), nullable=False),
        sa.Column("detail", sa.Text),
    ]


def upgrade() -> None:
    op.create_table("ax_audit", *_columns())
    op.create_index("ix_ax_audit_at", "ax_audit", ["at"])
    archive = _columns()
    archive[0] = sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False)
    op.create_table("ax_audit_archive", *archive)
    op.create_index("ix_ax_audit_archive_at", "ax_audit_archive", ["at"])


def downgrade() -> None:
    op.drop_table("ax_audit_archive")
    op.drop_table("ax_audit")
