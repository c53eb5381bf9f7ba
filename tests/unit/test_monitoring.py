"""The shipped monitoring (deploy/): alert rules and dashboard against the metrics ax exports.

* every metric an alert rule or a dashboard panel queries is defined in
  :mod:`ax_kombu.observability.metrics` (a renamed metric breaks this, not a page at night);
* the dashboard is importable JSON with a ``${DS_PROMETHEUS}`` input and the expected panels;
* ``promtool check rules`` and ``promtool test rules`` pass, and every panel expression
  parses as PromQL. Without promtool these skip, saying so; with
  ``AX_REQUIRE_SERVICES=1`` (CI) they fail. ``scripts/services.sh`` installs it (Debian
  package ``prometheus``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from prometheus_client import REGISTRY

from ax_kombu.cli import scheduler as scheduler_cli
from ax_kombu.cli import worker as worker_cli
from ax_kombu.observability import metrics

from ..services import unavailable

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "ax-alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "ax-alerts.test.yml"
#: issue 21's recorded backlog (bench/backlog_alerts.py writes it)
BACKLOG_RULE_TESTS = DEPLOY / "prometheus" / "ax-alerts.backlog.test.yml"
DASHBOARD = DEPLOY / "grafana" / "ax-dashboard.json"

#: the series names a metric family of each type exposes
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "info": ("_info",)}
METRIC = re.compile(r"\bax_[a-zA-Z0-9_:]*")
#: Grafana's variables, replaced by something PromQL parses
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$job": ".*"}

ALERTS = {"AxScheduleDelayHigh", "AxScheduleDelayCritical", "AxTasksOverdue", "AxNoScheduler",
          "AxQueueWithoutConsumer", "AxDispatchFailures", "AxAckTimeouts", "AxClockSkew"}


def exported_names() -> set[str]:
    """Every series name the metrics registered in the default registry expose."""
    assert metrics.schedule_delay is not None  # imported: ax's metrics are registered
    names: set[str] = set()
    for family in REGISTRY.collect():
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


def rules() -> list[dict[str, str]]:
    """The alerting rules' names, one-line ``expr``, ``for``, severity and priority.

    Read line by line (ax does not depend on a YAML parser); the promtool test below
    checks that this finds as many rules as Prometheus does.
    """
    found: list[dict[str, str]] = []
    for line in RULES.read_text().splitlines():
        if match := re.match(r"\s*- alert: (\w+)$", line):
            found.append({"alert": match[1]})
        elif found and (match := re.match(r"\s*(expr|for|summary): (.+)$", line)):
            found[-1][match[1]] = match[2].strip('"')
        elif found and (match := re.match(r"\s*labels: {severity: (\w+), priority: (P\d)}$",
                                          line)):
            found[-1].update(severity=match[1], priority=match[2])
    return found


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels() -> list[dict[str, Any]]:
    """The dashboard's panels, those nested in collapsed rows included (rows left out)."""
    found: list[dict[str, Any]] = []
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            found += panel.get("panels", [])
        else:
            found.append(panel)
    return found


def panel_exprs() -> list[str]:
    return [target["expr"] for panel in panels() for target in panel["targets"]]


def metric_names(expr: str) -> set[str]:
    return set(METRIC.findall(expr))


# -- (a) every metric queried exists ---------------------------------------------------------

def test_every_metric_an_alert_rule_queries_is_exported() -> None:
    exported = exported_names()
    for rule in rules():
        missing = metric_names(rule["expr"]) - exported
        assert not missing, f"{rule['alert']} queries metrics ax does not export: {missing}"


def test_every_metric_a_dashboard_panel_queries_is_exported() -> None:
    exported = exported_names()
    for panel in panels():
        for target in panel["targets"]:
            missing = metric_names(target["expr"]) - exported
            assert not missing, f"panel {panel['title']!r} queries unknown metrics: {missing}"


def test_the_name_check_would_catch_a_renamed_metric() -> None:
    exported = exported_names()
    assert {"ax_schedule_delay_seconds_bucket", "ax_dispatch_total", "ax_node_up",
            "ax_pool_busy"} <= exported
    assert metric_names("rate(ax_dispatch_totals[1m])") - exported == {"ax_dispatch_totals"}
    assert metric_names("ax_schedule_delay_seconds_bucket") - exported == set()


def test_the_shipped_rules_are_the_ones_the_spec_asks_for() -> None:
    by_name = {rule["alert"]: rule for rule in rules()}
    assert set(by_name) >= ALERTS
    for name, severity, priority in (("AxScheduleDelayHigh", "warning", "P2"),
                                     ("AxScheduleDelayCritical", "critical", "P1")):
        rule = by_name[name]
        assert "ax_start_delay_seconds_bucket" in rule["expr"] and rule["for"] == "1m"
        assert (rule["severity"], rule["priority"]) == (severity, priority)
    for rule in by_name.values():
        assert rule["expr"] and rule["summary"], rule
        assert rule["severity"] in {"warning", "critical"}, rule


def test_the_rules_have_one_source() -> None:
    assert not (DEPLOY.parent / "docs" / "alerts.yml").exists()


# -- the exporters' side ---------------------------------------------------------------------

def test_task_types_are_labels_only_when_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AX_METRICS_TASK_TYPES", raising=False)
    assert metrics.type_label("email.send") == "other"
    monkeypatch.setenv("AX_METRICS_TASK_TYPES", " email.send, report.build ,,")
    assert metrics.type_label("email.send") == "email.send"
    assert metrics.type_label("report.build") == "report.build"
    assert metrics.type_label("email") == "other"


def test_runs_are_counted_by_type_only_for_listed_types(monkeypatch: pytest.MonkeyPatch) -> None:
    from ax_kombu.config import Settings
    from ax_kombu.worker.outcomes import RunResult, decide
    from ax_kombu.worker.pools import Outcome
    from ax_kombu.worker.results import _observe
    from ax_kombu.worker.task import RunTask

    def count(task_type: str) -> float:
        return REGISTRY.get_sample_value(
            "ax_execute_total", {"queue": "slow", "result": "success", "task_type": task_type}) or 0

    monkeypatch.setenv("AX_METRICS_TASK_TYPES", "mon.listed")
    before = {t: count(t) for t in ("mon.listed", "mon.unlisted", "other")}
    batch = [RunResult(RunTask(task_id=i, attempt=1, task_type=task_type, payload=None,
                               trace_id="t", trigger_time=0, timeout_ms=1000, priority="slow",
                               retry_count=0, max_retry=0, processor=None, callback_url=None,
                               dispatched_at=0, node="s"),
                       Outcome(True, value=None, duration_s=0.001), 5)
             for i, task_type in enumerate(["mon.listed", "mon.listed", "mon.unlisted"])]
    _observe(batch, [decide(r, Settings(), None) for r in batch])  # type: ignore[arg-type]
    assert count("mon.listed") - before["mon.listed"] == 2
    assert count("other") - before["other"] == 1
    assert count("mon.unlisted") == before["mon.unlisted"] == 0


@pytest.mark.parametrize("command", [scheduler_cli.main, worker_cli.main])
def test_both_daemons_take_the_metrics_address(command: click.Command) -> None:
    options = {param.name: param for param in command.params}
    addr = options["metrics_addr"]
    assert isinstance(addr, click.Option)
    assert addr.opts == ["--metrics-addr"] and addr.envvar == "AX_METRICS_ADDR"
    assert addr.default == "127.0.0.1"
    assert "--metrics-addr" in CliRunner().invoke(command, ["--help"]).output


# -- (b) the dashboard -------------------------------------------------------------------------

def test_the_dashboard_is_importable_with_a_prometheus_input() -> None:
    board = dashboard()
    assert board["__inputs"] == [{"name": "DS_PROMETHEUS", "label": "Prometheus",
                                  "description": "", "type": "datasource",
                                  "pluginId": "prometheus", "pluginName": "Prometheus"}]
    assert board["schemaVersion"] >= 36
    assert board["uid"] and board["title"] and board["id"] is None
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        assert panel["title"] and panel["targets"], panel
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"


def test_the_dashboard_panels_tile_the_grid() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in dashboard()["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                 for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & taken, f"panel {panel['title']!r} overlaps another"
        taken |= cells


@pytest.mark.parametrize("needed", [
    "ax_schedule_delay_seconds_bucket", "ax_execute_total", "ax_oldest_overdue_seconds",
    "ax_pool_size", "ax_pool_busy", "ax_pool_prefetched", "ax_retry_count_bucket",
    "ax_clock_skew_seconds", "ax_dispatch_total", "ax_execute_timeout_total",
])
def test_the_dashboard_shows(needed: str) -> None:
    assert any(needed in metric_names(expr) for expr in panel_exprs())


# -- (c) promtool --------------------------------------------------------------------------------

def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    if path is None:
        unavailable("promtool", "not on PATH (scripts/services.sh installs Debian's "
                                "'prometheus' package, which ships it)")
    return subprocess.run([path, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=False)


def test_promtool_checks_the_rules() -> None:
    done = promtool("check", "rules", RULES.name, cwd=RULES.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout  # the line reader saw them all


@pytest.mark.parametrize("tests", [RULE_TESTS, BACKLOG_RULE_TESTS], ids=lambda p: p.name)
def test_promtool_runs_the_rule_unit_tests(tests: Path) -> None:
    done = promtool("test", "rules", tests.name, cwd=tests.parent)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_dashboard_expression_parses(tmp_path: Path) -> None:
    """Each panel expression, its Grafana variables filled in, as a recording rule."""
    records = []
    for number, expr in enumerate(panel_exprs()):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"an unknown Grafana variable in {expr!r}"
        records.append({"record": f"ax_dashboard_check_{number}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"  # JSON is YAML
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": records}]}))
    done = promtool("check", "rules", path.name, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
