"""The ``ax`` admin command. Each subcommand lives in its own module and only
parses arguments and calls the library."""

from __future__ import annotations

import logging
from typing import Any

import click

from .base import AxGroup, db_option
from .cancel import cancel
from .db import db
from .enqueue import enqueue
from .inspect import inspect
from .status import status


@click.group(cls=AxGroup, context_settings={"help_option_names": ["-h", "--help"]})
@db_option
@click.option("-l", "--loglevel", default="WARNING", envvar="AX_LOGLEVEL", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.version_option(package_name="ax_kombu")
@click.pass_context
def main(ctx: click.Context, database_url: str | None, loglevel: str) -> None:
    """ax: a distributed timed-task scheduler on Kombu."""
    logging.basicConfig(level=loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    obj: dict[str, Any] = {}
    if database_url:
        obj["database_url"] = database_url
    ctx.obj = obj


for command in (enqueue, inspect, cancel, db, status):
    main.add_command(command)
