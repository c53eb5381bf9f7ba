"""What the two daemons share: start-up checks, logging, the pidfile, and signal handlers
that only set flags."""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.broker.connection import check_broker_url
from ax_kombu.config import Settings
from ax_kombu.exceptions import ConfigurationError
from ax_kombu.observability.redaction import redact_url
from ax_kombu.store.engine import check_database_url

log = logging.getLogger("ax_kombu.daemon")

#: Each URL setting: its field, its variable, its flag, and the check that judges it.
_URL_CHECKS: tuple[tuple[str, str, str, Callable[[str], None]], ...] = (
    ("database_url", "AX_DATABASE_URL", "--db", check_database_url),
    ("broker_url", "AX_BROKER_URL", "--broker", check_broker_url),
)


def check_urls(settings: Settings) -> None:
    """Fail fast on a store or broker URL this installation can never use.

    Call it before a daemon opens anything or says it is ready. It parses
    both URLs and loads the database driver and the Kombu transport they
    name, without connecting: a server that is down is not a configuration
    error, and the daemons keep retrying it with backoff.

    Raises:
        ConfigurationError: its message starts with the setting as the user
            gave it: ``AX_DATABASE_URL`` / ``AX_BROKER_URL``, followed by the
            flag (``(--db)`` / ``(--broker)``) when the value came from it.
    """
    for field, variable, flag, check in _URL_CHECKS:
        try:
            check(getattr(settings, field))
        except ConfigurationError as exc:
            raise ConfigurationError(f"{_given_as(field, variable, flag)}: {exc}") from None


def _given_as(field: str, variable: str, flag: str) -> str:
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.get_parameter_source(field) is ParameterSource.COMMANDLINE:
        return f"{variable} ({flag})"
    return variable


class RedactingFormatter(logging.Formatter):
    """Every line, traceback included, with passwords and query-string values of any URL
    in it replaced by ``***`` (:func:`~ax_kombu.config.redact_url`): the last guard, so a
    URL inside an exception or a SQL parameter list never reaches a log."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_url(super().format(record))


#: The attributes every LogRecord has; anything else on a record came from ``extra``.
_PLAIN_ATTRS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def structured_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a call passed in ``extra={...}``, by name."""
    return {k: v for k, v in vars(record).items() if k not in _PLAIN_ATTRS}


class _TraceFormatter(RedactingFormatter):
    """Constant messages, then the structured fields passed in ``extra``; redacted."""

    def format(self, record: logging.LogRecord) -> str:
        line = logging.Formatter.format(self, record)
        fields = structured_fields(record)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in sorted(fields.items()))
        return redact_url(line)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (ISO 8601 UTC, ms), ``level``, ``logger``,
    ``message``, each field passed in ``extra`` as its own key, and ``exc`` (the
    traceback) when there is one.

    Every string in it is redacted as the text format is (:func:`~ax_kombu.config.redact_url`)
    before it is serialised, so the line is always valid JSON. A value JSON cannot hold
    is written as its ``str()``; a field named like one of the fixed keys is dropped.
    """

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in structured_fields(record).items():
            entry.setdefault(key, value)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(_redacted(entry))


def _redacted(value: Any) -> Any:
    """``value`` as JSON can hold it, with every string in it redacted."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {redact_url(str(k)): _redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redacted(v) for v in value]
    return redact_url(str(value))


#: ``--log-format``: the formatter each name stands for.
LOG_FORMATS: dict[str, Callable[[], logging.Formatter]] = {
    "text": lambda: _TraceFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"),
    "json": JsonFormatter,
}


def setup_logging(level: str, fmt: str = "text") -> None:
    """Send every record to stderr, at ``level`` and up, in the format named ``fmt``."""
    handler = logging.StreamHandler()
    handler.setFormatter(LOG_FORMATS[fmt.lower()]())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def log_format_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--log-format", envvar="AX_LOG_FORMAT", default="text", show_default=True,
                        type=click.Choice(sorted(LOG_FORMATS), case_sensitive=False),
                        help="text, or json: one object per line [AX_LOG_FORMAT]")(func)


class DaemonCommand(click.Command):
    """A daemon's command: a usage error (bad flag or value) is one line on stderr, exit 2."""

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else info_name
            click.echo(f"ax: error: {redact_url(exc.format_message())} (see '{where} -h')",
                       err=True)
            sys.exit(2)


@contextmanager
def pidfile(path: str | None) -> Iterator[None]:
    """Write our pid to ``path`` for the life of the block; refuse if a live process holds it."""
    if not path:
        yield
        return
    target = Path(path)
    if target.exists():
        try:
            os.kill(int(target.read_text().strip() or 0), 0)
        except (ValueError, ProcessLookupError):
            pass  # stale
        except PermissionError:
            raise ConfigurationError(f"pidfile {path} belongs to a running process") from None
        else:
            raise ConfigurationError(f"pidfile {path} belongs to a running process")
    target.write_text(f"{os.getpid()}\n")
    try:
        yield
    finally:
        target.unlink(missing_ok=True)


def freeze_start_up_objects() -> None:
    """Take everything built so far (modules, settings, pools) out of the collector's walks.

    A full garbage collection visits every tracked object, and after the imports
    alone there are hundreds of thousands: a pause of tens of milliseconds, in
    a process that times tasks to the millisecond. ``gc.freeze()`` moves them
    to a permanent generation that collections skip; objects made later are
    collected as usual.
    """
    gc.collect()
    gc.freeze()


def install_stop_signals(request_stop: Callable[[bool], None]) -> None:
    """First TERM/INT: warm stop; a second one, or QUIT: cold stop. Handlers only set flags."""
    count = {"n": 0}

    def on_signal(signum: int, _frame: Any) -> None:
        count["n"] += 1
        request_stop(signum == signal.SIGQUIT or count["n"] > 1)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, on_signal)


def fail(message: str, code: int = 2) -> None:
    print(f"ax: error: {redact_url(message)}", file=sys.stderr)
    sys.exit(code)


def declare_periodic_jobs(settings: Settings) -> threading.Thread | None:
    """Write the ``@ax.periodic`` jobs of the modules loaded (``-A``) to the store.

    On a thread that retries with backoff while the database is unreachable, so a daemon
    starts (and waits for its database) as usual. None when nothing was declared.
    """
    from ax_kombu.api import Client
    from ax_kombu.recurring import declared

    if not declared():
        return None

    def declare() -> None:
        delay = 0.5
        while True:
            try:
                client = Client(settings)
                try:
                    names = client.declare_periodic()
                finally:
                    client.close()
            except SQLAlchemyError as exc:
                log.warning("cannot write the @ax.periodic jobs yet; retrying",
                            extra={"error": str(getattr(exc, "orig", exc)), "retry_in_s": delay})
                time.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            log.info("periodic jobs declared", extra={"jobs": ",".join(names)})
            return

    thread = threading.Thread(target=declare, name="ax-declare-jobs", daemon=True)
    thread.start()
    return thread


def import_apps(apps: tuple[str, ...], settings: Settings) -> list[str]:
    """Import the ``-A`` modules (and ``AX_PROCESSOR_MODULES``) from the current directory,
    and register every typed task declared so far (:func:`ax_kombu.tasks.install`); returns
    the modules' names.

    Raises:
        ConfigurationError: a module cannot be imported.
    """
    from ax_kombu import tasks
    from ax_kombu.worker.processors import load_modules, split_names

    if os.getcwd() not in sys.path:  # -A app.tasks names a module of the current directory
        sys.path.insert(0, os.getcwd())
    modules = split_names(settings.processor_modules) + split_names(apps)
    load_modules(modules)
    tasks.install()  # typed tasks a module declared before the worker's code was loaded
    return modules
