"""``ax-worker -Q high,default,slow [-A app.tasks] [-c high=8,default=16,slow=8] …``

Every flag can also be given as an ``AX_*`` variable (shown in ``--help``).
SIGTERM or SIGINT stops warmly (exit 0); a second one, or SIGQUIT, stops
cold (exit 1). See :mod:`ax_kombu.worker`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import click

from ..config import PRIORITIES, from_env
from ..exceptions import ConfigurationError
from ..processors import Resolver, load_modules, split_names
from ..lanes import parse_queues
from ..worker import Worker
from .base import broker_option, db_option, run_guarded

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    """The constant message, then the record's structured fields as ``key=value``."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
        return line + "".join(f" {k}={v}" for k, v in fields.items())


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def parse_concurrency(text: str | None) -> dict[str, int]:
    """``"8"`` (every pool) or ``"high=8,slow=2"`` as ``pool_*`` settings.

    Raises:
        ConfigurationError: not in one of those forms.
    """
    if not text:
        return {}
    if text.strip().isdigit():
        return {f"pool_{p}": int(text) for p in PRIORITIES}
    sizes: dict[str, int] = {}
    for item in split_names(text):
        name, _, size = item.partition("=")
        if name.strip() not in PRIORITIES or not size.strip().isdigit():
            raise ConfigurationError(f"bad -c item {item!r}; use e.g. high=8,default=16,slow=8")
        sizes[f"pool_{name.strip()}"] = int(size)
    return sizes


def node_name(template: str | None) -> str | None:
    """``-n`` with ``%h`` (host name) and ``%p`` (pid) filled in."""
    if not template:
        return None
    return template.replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))


@contextmanager
def pidfile(path: str | None) -> Iterator[None]:
    """Write our pid to ``path`` for the run; refuse if another live process holds it."""
    if not path:
        yield
        return
    target = Path(path)
    if target.exists():
        text = target.read_text().strip()
        if text.isdigit() and _alive(int(text)):
            raise ConfigurationError(f"pidfile {path} names running process {text}")
    target.write_text(f"{os.getpid()}\n")
    try:
        yield
    finally:
        target.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def install_signals(worker: Worker) -> None:
    """TERM/INT: warm stop (cold if repeated); QUIT: cold. Handlers only set flags."""

    def warm(signum: int, frame: FrameType | None) -> None:
        worker.request_stop()

    def cold(signum: int, frame: FrameType | None) -> None:
        worker.request_stop(cold=True)

    signal.signal(signal.SIGTERM, warm)
    signal.signal(signal.SIGINT, warm)
    signal.signal(signal.SIGQUIT, cold)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-Q", "--queues", default=",".join(PRIORITIES), show_default=True,
              envvar="AX_WORKER_QUEUES", help="Queues to consume [AX_WORKER_QUEUES]")
@click.option("-A", "--app", "apps", multiple=True,
              help="Module registering processors; repeatable [AX_PROCESSOR_MODULES]")
@click.option("-c", "--concurrency", default=None, envvar="AX_WORKER_CONCURRENCY",
              help="Pool sizes: high=8,default=16,slow=8 or one number for all "
                   "[AX_WORKER_CONCURRENCY, AX_POOL_HIGH, …]")
@click.option("--prefetch-multiplier", type=int, default=None,
              help="Prefetch = free slots × this [AX_PREFETCH_MULTIPLIER]")
@click.option("-n", "--hostname", default=None, envvar="AX_WORKER_HOSTNAME",
              help="Node id (%h: host, %p: pid) [AX_WORKER_HOSTNAME]")
@click.option("-l", "--loglevel", default="INFO", envvar="AX_LOGLEVEL", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="[AX_LOGLEVEL]")
@click.option("--pidfile", default=None, envvar="AX_WORKER_PIDFILE",
              help="Write the pid here [AX_WORKER_PIDFILE]")
@db_option
@broker_option
def main(queues: str, apps: tuple[str, ...], concurrency: str | None,
         prefetch_multiplier: int | None, hostname: str | None, loglevel: str,
         pidfile: str | None, database_url: str | None, broker_url: str | None) -> None:
    """Run tasks from the high, default and slow queues in bounded pools."""
    setup_logging(loglevel)
    code = run_guarded(lambda: _run(queues, apps, concurrency, hostname, pidfile, {
        "prefetch_multiplier": prefetch_multiplier, "database_url": database_url,
        "broker_url": broker_url}))
    sys.exit(code)


def _run(queues: str, apps: tuple[str, ...], concurrency: str | None, hostname: str | None,
         pid_path: str | None, overrides: dict[str, Any]) -> int:
    settings = from_env(**overrides, **parse_concurrency(concurrency))
    modules = split_names(settings.processor_modules) + split_names(apps)
    settings = settings.replace(processor_modules=",".join(modules))
    chosen = parse_queues(queues, settings)
    load_modules(modules)
    resolver = Resolver(modules, split_names(settings.callback_allow_hosts))
    with pidfile(pid_path):
        worker = Worker(settings, queues=chosen, node_id=node_name(hostname), resolver=resolver)
        install_signals(worker)
        return worker.run()


if __name__ == "__main__":
    main()
