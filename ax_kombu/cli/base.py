"""What every ax command shares: settings from flags, and one-line errors."""

from __future__ import annotations

import getpass
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import click

from ax_kombu.api import Client
from ax_kombu.config import Settings, from_env, parse_duration_ms
from ax_kombu.exceptions import AxError, StoreError, ValidationError
from ax_kombu.observability.redaction import redact_url
from ax_kombu.store.audit import record

#: where the group's ``--as`` is kept (``ctx.meta`` is shared by every subcommand)
ACTOR_KEY = "ax_kombu.actor"


class OneLineGroup(click.Group):
    """A subcommand group whose usage errors (bad option value, missing argument) are one
    line on stderr and exit 2, like every other error of ``ax``."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
            click.echo(f"ax: error: {exc.format_message()} (see '{where} -h')", err=True)
            sys.exit(2)


@contextmanager
def client_for(ctx: click.Context) -> Iterator[Client]:
    """A producer client on the command's settings, closed after the block."""
    client = Client(settings_from(ctx))
    try:
        yield client
    finally:
        client.close()


class AxGroup(click.Group):
    """A click group that turns an :class:`AxError` into ``ax: error: …`` and its exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except AxError as exc:
            click.echo(f"ax: error: {redact_url(str(exc))}", err=True)
            sys.exit(exc.exit_code)


def run_guarded(func: Callable[[], Any]) -> Any:
    """Call ``func``; an AxError becomes a one-line message and its exit code."""
    try:
        return func()
    except AxError as exc:
        click.echo(f"ax: error: {redact_url(str(exc))}", err=True)
        sys.exit(exc.exit_code)


def os_user() -> str:
    """The OS user running the command (``uid:N`` when it has no name)."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return f"uid:{os.getuid()}"


def actor_of(ctx: click.Context) -> str:
    """Who the command acts as: ``ax --as NAME``, else the OS user."""
    given: str | None = ctx.meta.get(ACTOR_KEY)
    return given or os_user()


def audited(ctx: click.Context, engine: Any, action: str, target: str,
            detail: dict[str, Any] | None = None) -> None:
    """Record the action the command just took (:func:`ax_kombu.store.audit.record`,
    ``via="cli"``).

    Raises:
        StoreError: the record could not be written; the message says the action was.
    """
    try:
        record(engine, actor=actor_of(ctx), via="cli", action=action, target=target,
               detail=detail)
    except StoreError as exc:
        raise StoreError(f"{action} on {target} was done, but its audit record was not "
                         f"written: {exc}") from None


def db_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--db", "database_url", envvar="AX_DATABASE_URL", default=None,
                        help="Store URL: postgresql://… or sqlite:///path [AX_DATABASE_URL]")(func)


def broker_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--broker", "broker_url", envvar="AX_BROKER_URL", default=None,
                        help="Kombu broker URL: redis://…, amqp://… [AX_BROKER_URL]")(func)


def settings_from(ctx: click.Context, **overrides: Any) -> Settings:
    """Settings from AX_* variables, then the group's and this command's flags."""
    merged = dict(ctx.find_root().obj or {})
    merged.update({k: v for k, v in overrides.items() if v is not None})
    return from_env(**merged)


class Duration(click.ParamType):  # type: ignore[type-arg]
    """``500ms``, ``5s``, ``2m``, ``1h`` or bare seconds, as milliseconds."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_duration_ms(str(value))
        except AxError as exc:
            self.fail(str(exc), param, ctx)


class JsonValue(click.ParamType):  # type: ignore[type-arg]
    """A JSON document given on the command line."""

    name = "json"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            self.fail(f"not valid JSON ({exc.msg} at position {exc.pos}): {value!r}", param, ctx)


class IsoTime(click.ParamType):  # type: ignore[type-arg]
    """An ISO 8601 time with a UTC offset (``Z`` or ``+08:00``), as an aware datetime."""

    name = "iso-time"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> datetime:
        if isinstance(value, datetime):
            return value
        try:
            at = datetime.fromisoformat(str(value))
        except ValueError:
            raise ValidationError(f"--at {value!r} is not an ISO 8601 time, e.g. "
                                  "2026-12-24T20:00:00+08:00") from None
        if at.utcoffset() is None:
            raise ValidationError(f"--at {value!r} has no UTC offset; add one, e.g. "
                                  f"{at.isoformat()}+08:00 or {at.isoformat()}Z")
        return at
