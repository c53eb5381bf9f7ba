"""``ax alerts list|set TYPE|rm TYPE`` — per-type alerts to a signed webhook.

``set`` prints the alert's signing secret (a Standard Webhooks ``whsec_`` key) once, for
the receiver's verifier; ``list`` never shows it. See :func:`ax_kombu.set_alert` and
docs/alerts.md.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import click

from ax_kombu.cli.base import OneLineGroup, audited, client_for
from ax_kombu.exceptions import ValidationError
from ax_kombu.observability.redaction import url_origin


@click.group(cls=OneLineGroup)
def alerts() -> None:
    """Per-type alerts (failed or late tasks) to a signed webhook: list, set, rm."""


@alerts.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@click.pass_context
def list_alerts(ctx: click.Context, as_json: bool) -> None:
    """Every alert, by task type, and its open incident if any."""
    with client_for(ctx) as client:
        found = client.alerts()
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    if not found:
        click.echo("(no alerts)")
    for alert in found:
        late = (f" late_after={alert['late_after_ms'] / 1000:g}s"
                if alert["late_after_ms"] else "")
        incident = "quiet"
        if alert["opened_at"] is not None:
            opened = datetime.fromtimestamp(alert["opened_at"] / 1000, tz=UTC)
            incident = f"FIRING since {opened:%Y-%m-%d %H:%M:%S}Z ({alert['events']} events)"
        click.echo(f"{alert['task_type']}  on={','.join(alert['on'])}{late}  "
                   f"{alert['webhook']}  {incident}")


@alerts.command("set")
@click.argument("task_type")
@click.option("--on", "on", default=None,
              help="What to alert on: failed, late, or both (comma separated); default: "
                   "failed, and late with --late-after.")
@click.option("--late-after", default=None, metavar="DURATION",
              help="With 'late': a task not started this long past its time (30s, 5m).")
@click.option("--webhook", required=True, metavar="URL", help="The http(s) URL POSTed to.")
@click.option("--secret", default=None, envvar="AX_ALERT_SECRET", metavar="WHSEC",
              help="The signing key (whsec_…); default: the alert's, or a new one.")
@click.pass_context
def set_alert(ctx: click.Context, task_type: str, on: str | None, late_after: str | None,
              webhook: str, secret: str | None) -> None:
    """Alert WEBHOOK when TASK_TYPE's tasks fail or start late; prints the signing secret."""
    events = None if on is None else [e.strip() for e in on.split(",") if e.strip()]
    if events == []:
        raise ValidationError("--on needs failed, late or both")
    with client_for(ctx) as client:
        key = client.set_alert(task_type, on=events, late_after=late_after, webhook=webhook,
                               secret=secret)
        alert = next(a for a in client.alerts() if a["task_type"] == task_type)
        audited(ctx, client.store.engine, "alert_set", f"type:{task_type}",
                {"on": alert["on"], "late_after_ms": alert["late_after_ms"],
                 "webhook": url_origin(webhook)})  # its path or query may hold a token
    click.echo(f"{task_type}: alerting on {','.join(alert['on'])} to {webhook}")
    click.echo(f"signing secret (give it to the receiver): {key}")


@alerts.command("rm")
@click.argument("task_type")
@click.pass_context
def remove(ctx: click.Context, task_type: str) -> None:
    """Remove the alert of TASK_TYPE."""
    with client_for(ctx) as client:
        removed = client.remove_alert(task_type)
        if removed:
            audited(ctx, client.store.engine, "alert_remove", f"type:{task_type}")
    click.echo(f"{task_type}: alert removed" if removed else f"{task_type}: no alert")
