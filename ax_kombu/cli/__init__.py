"""The ``ax`` admin command. Each subcommand lives in its own module and only
parses arguments and calls the library."""

from __future__ import annotations

import logging
from typing import Any

import click

from ax_kombu.cli.alerts import alerts
from ax_kombu.cli.archive import archive
from ax_kombu.cli.audit import audit
from ax_kombu.cli.base import ACTOR_KEY, AxGroup, db_option
from ax_kombu.cli.cancel import cancel
from ax_kombu.cli.daemon import RedactingFormatter
from ax_kombu.cli.db import db
from ax_kombu.cli.enqueue import enqueue
from ax_kombu.cli.inspect import inspect
from ax_kombu.cli.jobs import jobs
from ax_kombu.cli.limits import limits
from ax_kombu.cli.list import list_tasks
from ax_kombu.cli.pauses import COMMANDS as PAUSE_COMMANDS
from ax_kombu.cli.plan import plan
from ax_kombu.cli.purge import purge
from ax_kombu.cli.reschedule import reschedule
from ax_kombu.cli.retry import retry
from ax_kombu.cli.status import status
from ax_kombu.cli.web import web
from ax_kombu.cli.workers import workers


@click.group(cls=AxGroup, context_settings={"help_option_names": ["-h", "--help"]})
@db_option
@click.option("-l", "--loglevel", default="WARNING", envvar="AX_LOGLEVEL", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--as", "actor", default=None, envvar="AX_ACTOR", metavar="NAME",
              help="Who the audit records as acting (default: the OS user) [AX_ACTOR]")
@click.version_option(package_name="ax_kombu")
@click.pass_context
def main(ctx: click.Context, database_url: str | None, loglevel: str,
         actor: str | None) -> None:
    """ax: a distributed timed-task scheduler on Kombu."""
    if actor is not None and not 1 <= len(actor.strip()) <= 128:
        raise click.BadParameter("must be 1 to 128 characters", param_hint="--as")
    ctx.meta[ACTOR_KEY] = actor.strip() if actor else None
    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=loglevel.upper(), handlers=[handler])
    obj: dict[str, Any] = {}
    if database_url:
        obj["database_url"] = database_url
    ctx.obj = obj


for command in (enqueue, inspect, cancel, reschedule, db, status, jobs, limits, plan,
                list_tasks, retry, purge, archive, audit, web):
    main.add_command(command)
main.add_command(alerts)
main.add_command(workers)
for command in PAUSE_COMMANDS:
    main.add_command(command)
