"""What every module of ax's tables shares: the one :class:`~sqlalchemy.MetaData` they
are all on (:mod:`ax_kombu.store.schema` gathers them; the migrations' environment
compares against it), and the archive's cold copies of a hot table."""

from __future__ import annotations

from sqlalchemy import Column, Index, MetaData, Table

metadata = MetaData()


def cold_copy(source: Table, name: str, *indexes: Index) -> Table:
    """``source``'s columns (types, nullability, primary key) under ``name``: no server
    defaults, constraints or indexes but ``indexes``."""
    return Table(name, metadata,
                 *(Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable,
                          autoincrement=False) for c in source.columns),
                 *indexes)
