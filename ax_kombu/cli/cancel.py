"""``ax cancel ID``"""

from __future__ import annotations

import click

from ax_kombu.api import Client
from ax_kombu.cli.base import settings_from


@click.command()
@click.argument("task_id", type=int)
@click.pass_context
def cancel(ctx: click.Context, task_id: int) -> None:
    """Cancel a task that has not finished."""
    client = Client(settings_from(ctx))
    try:
        view = client.cancel(task_id)
    finally:
        client.close()
    click.echo(f"{view.task_id} {view.status}")
