"""``ax-worker -Q high,default,slow [-A app.tasks] [-c high=8,default=16,slow=8] …``

Every flag can also be given as an ``AX_*`` variable (shown in ``--help``).
SIGTERM or SIGINT stops warmly (exit 0); a second one, or SIGQUIT, stops
cold (exit 1). SIGTSTP makes the worker quiet (it takes no new work; ``ax workers
resume NAME`` undoes it): :mod:`ax_kombu.worker.quiet`. See :mod:`ax_kombu.worker.node`.

``--processes`` is ``auto`` by default: one worker process per CPU core this
process may run on (each has its own GIL; a burst of short tasks is bounded by
one interpreter's CPU: docs/benchmarks.md, "Issue 21, third session"), and one on the
embedded SQLite store, which takes one writer at a time. ``--processes N`` (N > 1),
or ``auto`` on more than one core, runs a supervisor instead, which starts N workers
as ``python -m ax_kombu.cli.worker`` with the flags given here (less
``--processes``, ``--pidfile`` and the metrics flags, which the supervisor
keeps), each named ``NAME.i`` and told ``--supervised``. ``--db`` and
``--broker`` reach the children as ``AX_DATABASE_URL`` and ``AX_BROKER_URL``
in their environment, never on their command line, where ``ps`` would show a
password to every user of the host. See :mod:`ax_kombu.worker.supervisor`.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import click
from click.core import ParameterSource

from ax_kombu.cli.base import broker_option, db_option, run_guarded
from ax_kombu.cli.daemon import (
    DaemonCommand,
    check_urls,
    declare_periodic_jobs,
    freeze_start_up_objects,
    import_apps,
    install_stop_signals,
    log_format_option,
    pidfile,
    setup_logging,
)
from ax_kombu.config import PRIORITIES, Settings, from_env
from ax_kombu.exceptions import ConfigurationError
from ax_kombu.observability import metrics
from ax_kombu.observability.probes import REPORTS_ENV, Probe, Reporter, watch_reports
from ax_kombu.store.nodes import default_node_id
from ax_kombu.worker.lanes import parse_queues
from ax_kombu.worker.node import Worker
from ax_kombu.worker.processors import Resolver, split_names
from ax_kombu.worker.quiet import install_quiet_signal
from ax_kombu.worker.supervisor import (
    SharedMetrics,
    Supervisor,
    child_name,
    obey_supervisor,
)


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


class ProcessCount(click.ParamType):  # type: ignore[type-arg]
    """``--processes``: a count of at least 1, or ``auto`` (None)."""

    name = "N|auto"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int | None:
        if value is None or isinstance(value, int):
            return value
        if str(value).strip().lower() == "auto":
            return None
        try:
            count = int(value)
        except ValueError:
            self.fail(f"{value!r} is not a count or 'auto'", param, ctx)
        if count < 1:
            self.fail(f"{count} is not in the range x>=1 (or 'auto')", param, ctx)
        return count


@click.command(cls=DaemonCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-Q", "--queues", default=",".join(PRIORITIES), show_default=True,
              envvar="AX_WORKER_QUEUES", help="Queues to consume [AX_WORKER_QUEUES]")
@click.option("-A", "--app", "apps", multiple=True,
              help="Module registering processors; repeatable [AX_PROCESSOR_MODULES]")
@click.option("-c", "--concurrency", default=None, envvar="AX_WORKER_CONCURRENCY",
              help="Pool sizes: high=8,default=16,slow=8 or one number for all "
                   "[AX_WORKER_CONCURRENCY, AX_POOL_HIGH, …]")
@click.option("--prefetch-multiplier", type=int, default=None,
              help="Prefetch per queue = pool size × this [AX_PREFETCH_MULTIPLIER]")
@click.option("-n", "--hostname", default=None, envvar="AX_NODE_ID",
              help="Node id, unique per live worker (%h: host, %p: pid) [AX_NODE_ID]")
@click.option("-l", "--loglevel", default="INFO", envvar="AX_LOGLEVEL", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="[AX_LOGLEVEL]")
@log_format_option
@click.option("--pidfile", "pidfile_path", default=None, envvar="AX_PIDFILE",
              help="Write the pid here [AX_PIDFILE]")
@click.option("--metrics-port", envvar="AX_METRICS_PORT", type=int, default=0, show_default=True,
              help="Serve Prometheus /metrics on PORT, 0: off [AX_METRICS_PORT]")
@click.option("--metrics-addr", envvar="AX_METRICS_ADDR", default="127.0.0.1", show_default=True,
              help="Address /metrics listens on, 0.0.0.0: every interface [AX_METRICS_ADDR]")
@click.option("--processes", type=ProcessCount(), default="auto", show_default=True,
              envvar="AX_WORKER_PROCESSES",
              help="Worker processes under one supervisor, each with the full -c pools and "
                   "its own connections, named NAME.1 … NAME.N after -n NAME (%p: the "
                   "supervisor's pid); auto: one per CPU core, 1 on SQLite "
                   "[AX_WORKER_PROCESSES]")
@click.option("--supervised", is_flag=True, hidden=True,
              help="Run as a child of --processes: stop orders come on stdin")
@db_option
@broker_option
def main(queues: str, apps: tuple[str, ...], concurrency: str | None,
         prefetch_multiplier: int | None, hostname: str | None, loglevel: str,
         log_format: str, pidfile_path: str | None, metrics_port: int, metrics_addr: str,
         processes: int | None, supervised: bool, database_url: str | None,
         broker_url: str | None) -> None:
    """Run tasks from the high, default and slow queues in bounded pools.

    Settings not given as flags come from AX_* variables (see ax_kombu.config).
    """
    setup_logging(loglevel, log_format)
    overrides = {"prefetch_multiplier": prefetch_multiplier, "database_url": database_url,
                 "broker_url": broker_url}
    count = 1 if supervised else processes or run_guarded(
        lambda: worker_processes(from_env(**overrides)))
    if count > 1:
        argv = child_argv(click.get_current_context())
        sys.exit(run_guarded(lambda: _supervise(count, argv, queues, apps, concurrency,
                                                hostname, pidfile_path, metrics_port,
                                                metrics_addr, overrides)))
    sys.exit(run_guarded(lambda: _run(queues, apps, concurrency, hostname, pidfile_path,
                                      metrics_port, metrics_addr, supervised, overrides)))


def worker_processes(settings: Settings, cores: int | None = None) -> int:
    """``--processes auto``: one per CPU core this process may run on (``cores``), one
    on the embedded SQLite store."""
    if settings.is_sqlite:
        return 1
    return max(1, cores if cores is not None else len(os.sched_getaffinity(0)))


def _settings(queues: str, apps: tuple[str, ...], concurrency: str | None,
              overrides: dict[str, Any]) -> tuple[Settings, list[str], list[str]]:
    """The settings, the queues and the processor modules (imported), checked."""
    settings = from_env(**overrides, **parse_concurrency(concurrency))
    check_urls(settings)
    chosen = parse_queues(queues, settings)
    modules = import_apps(apps, settings)
    return settings.replace(processor_modules=",".join(modules)), chosen, modules


def _run(queues: str, apps: tuple[str, ...], concurrency: str | None, hostname: str | None,
         pid_path: str | None, metrics_port: int, metrics_addr: str, supervised: bool,
         overrides: dict[str, Any]) -> int:
    settings, chosen, modules = _settings(queues, apps, concurrency, overrides)
    resolver = Resolver(modules, split_names(settings.callback_allow_hosts),
                        settings.callback_secret, settings.callback_signing)
    with pidfile(pid_path):
        worker = Worker(settings, queues=chosen, node_id=node_name(hostname), resolver=resolver)
        declare_periodic_jobs(settings)
        install_quiet_signal(worker.request_quiet)
        if supervised:
            obey_supervisor(worker.request_stop, lambda: worker.stopping,
                            request_quiet=worker.request_quiet)
        else:
            install_stop_signals(lambda cold: worker.request_stop(cold))
        metrics.serve(metrics_port, metrics_addr, probe=worker.probe)
        if supervised and os.environ.get(REPORTS_ENV):  # the supervisor's probes read it
            Reporter(worker.probe, os.environ[REPORTS_ENV], worker.node_id,
                     settings.heartbeat_interval_s).start()
        metrics.node_up.labels(kind="worker").set(1)
        freeze_start_up_objects()
        return worker.run()


#: what the supervisor keeps to itself: each child gets its own -n, no pidfile, no endpoint
_SUPERVISOR_ONLY = frozenset({"processes", "supervised", "hostname", "pidfile_path",
                              "metrics_port", "metrics_addr"})
#: the variables of those flags, taken out of the children's environment
_SUPERVISOR_ONLY_ENV = ("AX_WORKER_PROCESSES", "AX_NODE_ID", "AX_PIDFILE", "AX_METRICS_PORT",
                        "AX_METRICS_ADDR")
#: flags that may hold a password: given to the children by environment, not on their argv
_BY_ENVIRONMENT = {"database_url": "AX_DATABASE_URL", "broker_url": "AX_BROKER_URL"}


def child_argv(ctx: click.Context) -> list[str]:
    """The flags given on this command line that a child worker repeats (not the
    supervisor's own, :data:`_SUPERVISOR_ONLY`, nor the URLs, :data:`_BY_ENVIRONMENT`).
    Settings from ``AX_*`` variables reach the children through the environment they
    inherit (:func:`child_env`)."""
    argv: list[str] = []
    for param in ctx.command.params:
        name = param.name or ""
        if (not isinstance(param, click.Option) or name in _SUPERVISOR_ONLY
                or name in _BY_ENVIRONMENT
                or ctx.get_parameter_source(name) is not ParameterSource.COMMANDLINE):
            continue
        flag = max(param.opts, key=len)
        for value in (ctx.params[name] if param.multiple else [ctx.params[name]]):
            if param.is_flag:
                argv += [flag] if value else []
            else:
                argv += [flag, str(value)]
    return argv


def child_env(environ: dict[str, str], overrides: dict[str, Any]) -> dict[str, str]:
    """The children's environment: this one less the supervisor's own variables, with
    ``--db`` and ``--broker`` (when given) as ``AX_DATABASE_URL`` and ``AX_BROKER_URL``."""
    env = {k: v for k, v in environ.items() if k not in _SUPERVISOR_ONLY_ENV}
    env.update({var: str(overrides[name]) for name, var in _BY_ENVIRONMENT.items()
                if overrides.get(name) is not None})
    return env


def _supervise(processes: int, argv: list[str], queues: str, apps: tuple[str, ...],
               concurrency: str | None, hostname: str | None, pid_path: str | None,
               metrics_port: int, metrics_addr: str, overrides: dict[str, Any]) -> int:
    """Check the settings once, then run ``processes`` workers under a supervisor."""
    settings = _settings(queues, apps, concurrency, overrides)[0]  # a bad one fails here, once
    base = node_name(hostname) or default_node_id("worker")
    env = child_env(dict(os.environ), overrides)
    shared = SharedMetrics() if metrics_port else None
    try:
        with pidfile(pid_path):
            if shared is not None:
                env.update(shared.env)
                shared.serve(metrics_port, metrics_addr, _children_probe(
                    shared, [child_name(base, i) for i in range(1, processes + 1)], settings))
            supervisor = Supervisor(
                lambda name: [sys.executable, "-m", "ax_kombu.cli.worker", *argv,
                              "-n", name, "--supervised"],
                base, processes, env=env,
                on_exit=shared.process_dead if shared is not None else lambda pid: None)
            install_stop_signals(supervisor.request_stop)
            install_quiet_signal(supervisor.request_quiet)
            return supervisor.run()
    finally:
        if shared is not None:
            shared.close()


def _children_probe(shared: SharedMetrics, names: list[str], settings: Settings) -> Probe:
    """The supervisor's probes: healthy while every child reports itself live, ready while
    every child is ready (from the reports the children write, fresh within the window)."""
    probe = Probe()
    watch_reports(probe, shared.reports, lambda: names, settings.silence_ms / 1000.0)
    return probe


if __name__ == "__main__":
    main()
