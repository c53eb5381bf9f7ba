"""``ax db upgrade`` / ``ax db current`` — schema migrations (Alembic)."""

from __future__ import annotations

import click

from ax_kombu.cli.base import settings_from
from ax_kombu.observability.redaction import redact_url
from ax_kombu.store.engine import current_revision, make_engine, migrate


@click.group()
def db() -> None:
    """Schema migrations."""


@db.command()
@click.argument("revision", default="head")
@click.pass_context
def upgrade(ctx: click.Context, revision: str) -> None:
    """Upgrade the store's schema (default: to the newest revision)."""
    settings = settings_from(ctx)
    engine = make_engine(settings.database_url)
    try:
        migrate(engine, revision)
        click.echo(f"{redact_url(settings.database_url)} is at revision "
                   f"{current_revision(engine)}")
    finally:
        engine.dispose()


@db.command()
@click.pass_context
def current(ctx: click.Context) -> None:
    """Print the store's schema revision."""
    engine = make_engine(settings_from(ctx).database_url)
    try:
        click.echo(current_revision(engine) or "(empty: run 'ax db upgrade')")
    finally:
        engine.dispose()
