"""What the two daemons share: start-up checks, logging, the pidfile, and signal handlers
that only set flags."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import click
from click.core import ParameterSource
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.broker.connection import check_broker_url
from ax_kombu.config import Settings, redact_url
from ax_kombu.exceptions import ConfigurationError
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


class _TraceFormatter(RedactingFormatter):
    """Constant messages, then the structured fields passed in ``extra``; redacted."""

    _PLAIN: ClassVar[frozenset[str]] = frozenset(vars(logging.makeLogRecord({})))

    def format(self, record: logging.LogRecord) -> str:
        line = logging.Formatter.format(self, record)
        fields = {k: v for k, v in vars(record).items()
                  if k not in self._PLAIN and k not in {"message", "asctime"}}
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in sorted(fields.items()))
        return redact_url(line)


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(_TraceFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


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
    """Import the ``-A`` modules (and ``AX_PROCESSOR_MODULES``) from the current directory;
    returns their names.

    Raises:
        ConfigurationError: a module cannot be imported.
    """
    from ax_kombu.worker.processors import load_modules, split_names

    if os.getcwd() not in sys.path:  # -A app.tasks names a module of the current directory
        sys.path.insert(0, os.getcwd())
    modules = split_names(settings.processor_modules) + split_names(apps)
    load_modules(modules)
    return modules
