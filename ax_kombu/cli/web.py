"""``ax web`` — the operator's console in a browser (:mod:`ax_kombu.web`).

Listens on 127.0.0.1:5555 unless told otherwise; any address but a loopback one needs
``AX_WEB_TOKEN`` and without it ``ax web`` refuses to start. Its dependencies are the
``web`` extra: ``pip install 'ax_kombu[web]'``.
"""

from __future__ import annotations

import os

import click

from ax_kombu.cli.base import broker_option, settings_from
from ax_kombu.exceptions import ConfigurationError
from ax_kombu.web.security import check_bind


@click.command()
@click.option("--port", default=5555, show_default=True, envvar="AX_WEB_PORT",
              type=click.IntRange(0, 65535), help="TCP port [AX_WEB_PORT]")
@click.option("--bind", default="127.0.0.1", show_default=True, envvar="AX_WEB_BIND",
              help="Address to listen on; a non-loopback one needs AX_WEB_TOKEN [AX_WEB_BIND]")
@broker_option
@click.pass_context
def web(ctx: click.Context, port: int, bind: str, broker_url: str | None) -> None:
    """Serve the web console (nodes, lateness, tasks, jobs, limits).

    With AX_WEB_TOKEN set, every page needs that token (a login form, or an
    Authorization: Bearer header)."""
    token = os.environ.get("AX_WEB_TOKEN") or None
    check_bind(bind, token)
    try:
        from ax_kombu.web.app import serve
    except ImportError as exc:
        missing = (exc.name or "its dependencies").split(".")[0]
        raise ConfigurationError(f"ax web needs {missing}, which is not installed: "
                                 "pip install 'ax_kombu[web]'") from None
    serve(settings_from(ctx, broker_url=broker_url), bind, port, token)
