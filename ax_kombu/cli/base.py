"""What every ax command shares: settings from flags, and one-line errors."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import click

from ax_kombu.api import Client
from ax_kombu.config import Settings, from_env, parse_duration_ms
from ax_kombu.exceptions import AxError, ValidationError
from ax_kombu.observability.redaction import redact_url


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
