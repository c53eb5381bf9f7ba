"""``ax web`` — the operator's console in a browser (:mod:`ax_kombu.web`), and ``ax web
adduser NAME --role R``, which adds a user to the ``AX_WEB_USERS`` file.

Listens on 127.0.0.1:5555 unless told otherwise; any address but a loopback one needs
credentials (``AX_WEB_TOKEN``, ``AX_WEB_USERS`` or ``AX_WEB_TRUSTED_HEADER`` with
``AX_WEB_ROLE_MAP``) and without them ``ax web`` refuses to start. A malformed users file
or role map is refused with one line before anything listens. Its dependencies are the
``web`` extra: ``pip install 'ax_kombu[web]'``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ax_kombu.cli.base import OneLineGroup, broker_option, settings_from
from ax_kombu.exceptions import ConfigurationError
from ax_kombu.web.access import Access
from ax_kombu.web.security import ROLES, check_bind
from ax_kombu.web.users import add_user


@click.group(cls=OneLineGroup, invoke_without_command=True)
@click.option("--port", default=5555, show_default=True, envvar="AX_WEB_PORT",
              type=click.IntRange(0, 65535), help="TCP port [AX_WEB_PORT]")
@click.option("--bind", default="127.0.0.1", show_default=True, envvar="AX_WEB_BIND",
              help="Address to listen on; a non-loopback one needs AX_WEB_TOKEN, "
                   "AX_WEB_USERS or AX_WEB_TRUSTED_HEADER [AX_WEB_BIND]")
@broker_option
@click.pass_context
def web(ctx: click.Context, port: int, bind: str, broker_url: str | None) -> None:
    """Serve the web console (nodes, lateness, tasks, jobs, limits, audit).

    With AX_WEB_TOKEN set, the token logs in as admin (a login form, or an
    Authorization: Bearer header). With AX_WEB_USERS (a file ax web adduser writes),
    users log in with their password and act with their role (viewer, operator,
    admin). With AX_WEB_TRUSTED_HEADER and AX_WEB_ROLE_MAP, a reverse proxy names the
    user. ax web adduser NAME --role R adds a user."""
    if ctx.invoked_subcommand is not None:
        return
    token = os.environ.get("AX_WEB_TOKEN") or None
    access = Access.configure(token, os.environ)
    check_bind(bind, token, users=access.guarded)
    try:
        from ax_kombu.web.app import serve
    except ImportError as exc:
        missing = (exc.name or "its dependencies").split(".")[0]
        raise ConfigurationError(f"ax web needs {missing}, which is not installed: "
                                 "pip install 'ax_kombu[web]'") from None
    serve(settings_from(ctx, broker_url=broker_url), bind, port, access)


def _password(from_stdin: bool) -> str:
    if from_stdin:
        return sys.stdin.readline().rstrip("\r\n")
    entered: str = click.prompt("Password", hide_input=True, confirmation_prompt=True)
    return entered


@web.command()
@click.argument("name")
@click.option("--role", required=True, type=click.Choice(ROLES),
              help="viewer: reads; operator: also cancels, retries, moves, pauses; "
                   "admin: also limits.")
@click.option("--password-stdin", is_flag=True,
              help="Read the password from the first line of standard input.")
@click.option("--file", "path", envvar="AX_WEB_USERS", default=None,
              type=click.Path(dir_okay=False, path_type=Path),
              help="The users file [AX_WEB_USERS]")
def adduser(name: str, role: str, password_stdin: bool, path: Path | None) -> None:
    """Add user NAME with role R to the users file, or give them a new role and password.

    The file is rewritten atomically, mode 0600; the password is stored as an argon2
    hash. A running console sees the change at the user's next request."""
    if path is None:
        raise ConfigurationError("name the users file: --file PATH or AX_WEB_USERS")
    created = add_user(path, name, role, _password(password_stdin))
    click.echo(f"{'added' if created else 'updated'} {name} ({role}) in {path}")
