"""``ax-scheduler``: the scheduling daemon. Every flag is also an ``AX_*`` variable."""

from __future__ import annotations

import logging
import sys

import click

from ax_kombu.celery.handoff import CeleryHandOff
from ax_kombu.cli.base import Duration, broker_option, db_option, run_guarded
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
from ax_kombu.observability import metrics
from ax_kombu.observability.redaction import redact_url
from ax_kombu.scheduler.node import Scheduler

log = logging.getLogger("ax_kombu.scheduler.node")


@click.command(cls=DaemonCommand, context_settings={"help_option_names": ["-h", "--help"]})
@db_option
@broker_option
@click.option("-n", "--node-id", envvar="AX_NODE_ID", default=None, help="This node's name (default kind@host.pid).")
@click.option("-l", "--loglevel", envvar="AX_LOGLEVEL", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@log_format_option
@click.option("-A", "--app", "apps", multiple=True,
              help="Module declaring @ax.periodic jobs to write at start; repeatable "
                   "[AX_PROCESSOR_MODULES]")
@click.option("--pidfile", "pidfile_path", envvar="AX_PIDFILE", default=None, help="Write the pid here.")
@click.option("--metrics-port", envvar="AX_METRICS_PORT", type=int, default=0, show_default=True,
              help="Serve Prometheus /metrics on PORT (0: off).")
@click.option("--metrics-addr", envvar="AX_METRICS_ADDR", default="127.0.0.1", show_default=True,
              help="Address /metrics listens on (0.0.0.0: every interface).")
@click.option("--preload-window", "preload_window_ms", type=Duration(), default=None,
              help="How far ahead tasks are loaded (default 10s).")
@click.option("--claim-batch", type=int, default=None, help="Tasks per claim (default 1000).")
@click.option("--ack-timeout", "ack_timeout_ms", type=Duration(), default=None,
              help="Re-dispatch a task no worker started within this (default 30s).")
@click.option("--recovery-interval", "recovery_interval_s", type=float, default=None,
              help="Seconds between recovery scans (default 30).")
def main(node_id: str | None, loglevel: str, log_format: str, apps: tuple[str, ...],
         pidfile_path: str | None, metrics_port: int, metrics_addr: str,
         **overrides: object) -> None:
    """Run one scheduler node: preload, timing wheel, claim, publish, recover.

    Settings not given as flags come from AX_* variables (see ax_kombu.config).
    """
    from ax_kombu.config import from_env

    setup_logging(loglevel, log_format)
    settings = run_guarded(lambda: from_env(**overrides))
    run_guarded(lambda: check_urls(settings))
    run_guarded(lambda: import_apps(apps, settings))
    with pidfile(pidfile_path):
        scheduler = run_guarded(lambda: Scheduler(settings, node_id,
                                                  publish_hooks=(CeleryHandOff,)))
        install_stop_signals(lambda cold: scheduler.request_stop(cold))
        declare_periodic_jobs(settings)
        metrics.serve(metrics_port, metrics_addr, probe=scheduler.probe)
        metrics.node_up.labels(kind="scheduler").set(1)
        freeze_start_up_objects()
        log.info("ax-scheduler ready", extra={"node": scheduler.node_id,
                                              "db": redact_url(settings.database_url),
                                              "broker": redact_url(settings.broker_url)})
        code = run_guarded(scheduler.run)
    sys.exit(code)


if __name__ == "__main__":
    main()
