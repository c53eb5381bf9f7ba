"""The deploy files (deploy/docker, deploy/compose.yaml, deploy/kubernetes) against the package.

Checked statically (no Docker daemon, compose or cluster is needed): every YAML file parses;
every ax command a file runs is one of the package's console scripts and its arguments parse
with that script's own click command; the Kubernetes manifests pass ``kubernetes-validate``
(strict), name each pod's node after the pod (``-n $(POD_NAME)``, the downward API), probe
``/healthz`` and ``/readyz`` on the port the daemon is told to serve, and give a worker longer
to stop than its warm stop may take; the image runs as a non-root user; the compose file has
its six services, ordered by healthchecks and the one-shot migration.
Without ``kubernetes-validate`` or ``promtool`` those checks skip (fail with
``AX_REQUIRE_SERVICES=1``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import shlex
import shutil
import socket
import subprocess
import threading
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import click
import pytest
import yaml

from ax_kombu.config import Settings, from_env
from ax_kombu.config_sections import WorkerSettings
from ax_kombu.worker.lanes import parse_queues
from tests.services import unavailable

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
K8S = DEPLOY / "kubernetes"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
#: what Kubernetes puts in place of $(POD_NAME) in a StatefulSet's pod
POD_NAME = "ax-worker-0"
SIX = {"postgres", "redis", "scheduler", "worker", "web", "prometheus"}


# -- the console scripts and their click commands ----------------------------------------------

def script_command(name: str) -> click.Command:
    if name not in SCRIPTS:
        pytest.fail(f"{name!r} is not a console script of the package: {sorted(SCRIPTS)}")
    module, _, attr = SCRIPTS[name].partition(":")
    command = getattr(importlib.import_module(module), attr)
    assert isinstance(command, click.Command)
    return command


def parse(argv: list[str]) -> click.Context:
    """The context of the command ``argv`` runs (a subcommand's for ``ax db upgrade``), its
    options parsed by click as the real script would; a flag or value it refuses fails the
    test. Nothing is run."""
    assert argv, "an empty command"
    command: click.Command = script_command(argv[0])
    name, args, parent = argv[0], list(argv[1:]), None
    try:
        while isinstance(command, click.Group):
            ctx = command.context_class(command, info_name=name, parent=parent)
            with ctx.scope(cleanup=False):
                rest = click.Command.parse_args(command, ctx, args)
                if not rest and command.invoke_without_command:
                    return ctx  # the group runs itself (`ax web`)
                if not rest:
                    ctx.fail("Missing command.")
                sub_name, sub, args = command.resolve_command(ctx, rest)
            assert sub is not None and sub_name is not None, argv
            command, name, parent = sub, sub_name, ctx
        return command.make_context(name, args, parent=parent)
    except SystemExit as exc:  # a daemon's command reports a usage error and exits 2
        pytest.fail(f"{shlex.join(argv)}: the CLI refused it (exit {exc.code})")
    except click.UsageError as exc:
        pytest.fail(f"{shlex.join(argv)}: {exc.format_message()}")


def ax_envvars() -> set[str]:
    """Every AX_* variable ax reads: the settings' and the CLI options'."""
    names = {f"AX_{field.name.upper()}" for field in dataclasses.fields(Settings)}

    def walk(command: click.Command) -> None:
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            names.update([envvar] if isinstance(envvar, str) else envvar or [])
        if isinstance(command, click.Group):
            for sub in command.commands.values():
                walk(sub)

    for script in SCRIPTS:
        walk(script_command(script))
    return names


def test_the_parser_refuses_what_the_cli_refuses() -> None:
    """The check below has teeth: unknown flags, bad values, unknown subcommands fail."""
    for bad in (["ax-worker", "--no-such-flag"], ["ax-scheduler", "--metrics-port", "x"],
                ["ax", "db", "downgrade"], ["ax", "web", "--port", "70000"], ["ax-beat"]):
        with pytest.raises(pytest.fail.Exception):
            parse(bad)
    assert parse(["ax", "web", "--port", "5555"]).params["port"] == 5555


# -- every YAML file --------------------------------------------------------------------------

def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml"))


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path) -> None:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert docs and all(isinstance(doc, dict) for doc in docs)


# -- the image ----------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    joined, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            joined.append(pending.strip())
            pending = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in joined]


def final_stage() -> list[tuple[str, str]]:
    steps = dockerfile_instructions()
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def exec_form(arguments: str) -> list[str]:
    argv = yaml.safe_load(arguments)  # a JSON array is YAML too
    assert isinstance(argv, list), f"not in exec form: {arguments}"
    return [str(a) for a in argv]


def image_uid() -> str:
    users = [args for op, args in final_stage() if op == "USER"]
    assert users, "the image runs as root: no USER in its final stage"
    return users[-1].split(":")[0]


def test_the_image_runs_as_a_non_root_user() -> None:
    uid = image_uid()
    assert uid not in ("root", "0")
    assert uid.isdigit(), "a numeric USER lets Kubernetes' runAsNonRoot check it"


def test_the_image_is_python_3_11_slim_and_installs_the_extras_it_names() -> None:
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for op, a in dockerfile_instructions()
            if op == "ARG" and "=" in a}
    assert args["PYTHON_IMAGE"].startswith("python:3.11-slim")
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(args["AX_EXTRAS"].split(",")) <= set(extras)
    assert "web" in args["AX_EXTRAS"].split(","), "ax web needs the web extra"


def test_the_images_commands_exist() -> None:
    """CMD and HEALTHCHECK, and the `docker run` lines of the file's own header."""
    stage = final_stage()
    cmd = exec_form(next(a for op, a in reversed(stage) if op == "CMD"))
    with pytest.raises(click.exceptions.Exit) as exited:  # `ax --help` prints and exits 0
        parse(cmd)
    assert exited.value.exit_code == 0
    health = next(a for op, a in stage if op == "HEALTHCHECK")
    probe = exec_form(health.split(" CMD ", 1)[1])
    copied = {dest: src for op, a in stage if op == "COPY" and "--from" not in a
              for src, dest in [a.split()[-2:]]}
    assert probe[-1] in copied and (ROOT / copied[probe[-1]]).is_file()
    runs = [line.split("ax_kombu:local", 1)[1].split() for line in
            DOCKERFILE.read_text().splitlines() if line.startswith("#   docker run ")]
    assert {argv[0] for argv in runs} >= {"ax-scheduler", "ax-worker", "ax"}
    for argv in runs:
        parse(argv)


def test_the_build_context_sends_what_the_build_copies() -> None:
    """Every COPY source exists, and the ignore file (everything out, then `!` back in)
    lets it through."""
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
    assert "**" in ignore
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    sources = [src for op, a in dockerfile_instructions() if op == "COPY" and "--from" not in a
               for src in a.split()[:-1]]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert src.rstrip("/").removeprefix("./") in allowed, f"{src} is ignored"


# -- the image's health check -----------------------------------------------------------------

def healthcheck_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ax_healthcheck",
                                                  DEPLOY / "docker" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def probe_server() -> Iterator[tuple[int, dict[str, int]]]:
    """A loopback server answering /healthz with the status in ``state["status"]``."""
    state = {"status": 200}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"ok": true}\n' if state["status"] == 200 else b'{"ok": false}\n'
            if self.path == "/login-first":  # a console answering before its login
                self.send_response(303)
                self.send_header("Location", "/healthz")
            else:
                self.send_response(state["status"] if self.path == "/healthz" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_health_check_passes_on_200_only(probe_server: tuple[int, dict[str, int]],
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    port, state = probe_server
    health = healthcheck_module()
    monkeypatch.delenv("AX_HEALTH_URL", raising=False)
    monkeypatch.setenv("AX_METRICS_PORT", str(port))
    assert health.main() == 0
    assert capsys.readouterr().out == '{"ok": true}\n'  # the answer's one line
    state["status"] = 503
    assert health.main() == 1
    assert '503 {"ok": false}' in capsys.readouterr().out
    monkeypatch.setenv("AX_HEALTH_URL", f"http://127.0.0.1:{port}/elsewhere")
    assert health.main() == 1  # the URL given wins over the metrics port: 404 there
    monkeypatch.setenv("AX_HEALTH_URL", f"http://127.0.0.1:{port}/healthz")
    state["status"] = 200
    assert health.main() == 0
    monkeypatch.setenv("AX_HEALTH_URL", f"http://127.0.0.1:{port}/login-first")
    assert health.main() == 1, "a redirect (to a 200 page) is not a pass"


def test_the_health_check_fails_without_a_port_or_a_server() -> None:
    health = healthcheck_module()
    assert health.probe_url({"AX_METRICS_PORT": "0"}) is None
    assert health.probe_url({}) is None
    assert health.probe_url({"AX_METRICS_PORT": "9108"}) == "http://127.0.0.1:9108/healthz"
    with socket_closed_port() as port:
        healthy, why = health.check(f"http://127.0.0.1:{port}/healthz", timeout_s=2)
    assert not healthy and "refused" in why.lower()


@contextmanager
def socket_closed_port() -> Iterator[int]:
    """A loopback port nothing listens on (bound, never listening)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


# -- compose -------------------------------------------------------------------------------------

def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def ax_services() -> dict[str, dict[str, Any]]:
    """The services that run the image built from deploy/docker/Dockerfile: one builds it,
    the others run it and never pull it (no registry has it)."""
    services = compose()["services"]
    (builder,) = [s for s in services.values() if s.get("build")]
    build = builder["build"]
    assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    found = {name: s for name, s in services.items() if s.get("image") == builder["image"]}
    for service in found.values():
        assert service is builder or service["pull_policy"] == "never"
    return found


def option(argv: list[str], *names: str) -> str | None:
    for i, arg in enumerate(argv[:-1]):
        if arg in names:
            return argv[i + 1]
    return None


def test_compose_has_the_six_services_and_a_one_shot_migration() -> None:
    services = compose()["services"]
    assert SIX <= set(services)
    assert set(ax_services()) == {"migrate", "scheduler", "worker", "web"}
    assert services["migrate"]["command"] == ["ax", "db", "upgrade"]
    assert services["migrate"]["restart"] == "no"


@pytest.mark.parametrize("name", ["migrate", "scheduler", "worker", "web"])
def test_each_compose_command_is_a_console_script_the_cli_accepts(name: str) -> None:
    argv = ax_services()[name]["command"]
    ctx = parse(argv)
    if argv[0] == "ax-worker":
        parse_queues(ctx.params["queues"], from_env({}))


def test_compose_starts_each_service_after_what_it_needs() -> None:
    services = compose()["services"]
    for name, service in services.items():
        if name != "migrate":
            test = service["healthcheck"]["test"]
            assert test[0] == "CMD" and not service["healthcheck"].get("disable"), name
        for needed, how in (service.get("depends_on") or {}).items():
            assert needed in services, (name, needed)
            if how["condition"] == "service_healthy":
                assert not services[needed]["healthcheck"].get("disable"), (name, needed)
    for name in ("scheduler", "worker", "web"):
        needs = services[name]["depends_on"]
        assert needs["migrate"]["condition"] == "service_completed_successfully"
        assert needs["postgres"]["condition"] == needs["redis"]["condition"] == "service_healthy"


def test_compose_healthchecks_probe_the_port_the_daemon_serves() -> None:
    """The image's check reads AX_METRICS_PORT (or AX_HEALTH_URL): it must be the port the
    command serves on, on an address other containers reach."""
    for name in ("scheduler", "worker"):
        service = ax_services()[name]
        port = option(service["command"], "--metrics-port")
        assert port is not None and port == str(service["environment"]["AX_METRICS_PORT"])
        assert option(service["command"], "--metrics-addr") == "0.0.0.0"
    web = ax_services()["web"]
    port = option(web["command"], "--port")
    assert web["environment"]["AX_HEALTH_URL"] == f"http://127.0.0.1:{port}/healthz"
    assert option(web["command"], "--bind") == "0.0.0.0"
    assert "AX_WEB_TOKEN" in web["environment"], "ax web beyond loopback needs the token"


def test_compose_stops_a_worker_after_its_warm_stop() -> None:
    grace = compose()["services"]["worker"]["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) > WorkerSettings().worker_grace_s


def test_compose_mounts_files_that_exist() -> None:
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).is_file(), (name, source)


def test_compose_prometheus_scrapes_the_daemons_and_loads_the_rules(tmp_path: Path) -> None:
    services = compose()["services"]
    mounts = dict(v.split(":")[1::-1] for v in services["prometheus"]["volumes"])
    config_path = COMPOSE.parent / mounts["/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load(config_path.read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    for name in ("scheduler", "worker"):
        assert f"{name}:{option(services[name]['command'], '--metrics-port')}" in targets
    (rule_file,) = config["rule_files"]
    assert (COMPOSE.parent / mounts[rule_file]).resolve() == DEPLOY / "prometheus/ax-alerts.yml"
    # promtool on the same config, the rules where it says they are
    path = shutil.which("promtool")
    if path is None:
        unavailable("promtool", "not on PATH (Debian's 'prometheus' package ships it)")
    shutil.copy(DEPLOY / "prometheus/ax-alerts.yml", tmp_path / "ax-alerts.yml")
    config["rule_files"] = ["ax-alerts.yml"]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    done = subprocess.run([path, "check", "config", "prometheus.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


# -- Kubernetes ----------------------------------------------------------------------------------

def kustomization() -> dict[str, Any]:
    data = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert isinstance(data, dict)
    return data


def manifests() -> list[dict[str, Any]]:
    return [doc for name in kustomization()["resources"]
            for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def one(kind: str, name: str) -> dict[str, Any]:
    (found,) = [m for m in manifests() if m["kind"] == kind and m["metadata"]["name"] == name]
    return found


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    assert isinstance(only, dict)
    return only


def argv_of(c: dict[str, Any]) -> list[str]:
    return [str(a) for a in [*c["command"], *c.get("args", [])]]


def configmap_data() -> dict[str, str]:
    data: dict[str, str] = one("ConfigMap", "ax-settings")["data"]
    return data


def test_kustomization_lists_every_manifest() -> None:
    listed = kustomization()["resources"]
    present = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == present
    assert {m["kind"] for m in manifests()} >= {
        "StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "Job", "Secret",
        "ConfigMap"}


def test_the_manifests_pass_kubernetes_validate() -> None:
    try:
        import kubernetes_validate  # type: ignore[import-untyped]
    except ImportError as exc:
        unavailable("kubernetes-validate", exc)
    version = kubernetes_validate.latest_version()
    for manifest in manifests():
        kubernetes_validate.validate(manifest, version, strict=True)
    broken = {**one("ConfigMap", "ax-settings"), "dat": {}}  # strict: an unknown field fails
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


@pytest.mark.parametrize("name", ["ax-scheduler", "ax-worker"])
def test_statefulsets_name_each_node_after_its_pod(name: str) -> None:
    workload = one("StatefulSet", name)
    c = container(workload)
    argv = argv_of(c)
    assert argv[0] == name
    assert option(argv, "-n", "--node-id", "--hostname") == "$(POD_NAME)"
    pod_name = next(e for e in c["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert workload["spec"]["serviceName"] == one("Service", name)["metadata"]["name"]
    ctx = parse([a.replace("$(POD_NAME)", POD_NAME) for a in argv])
    if name == "ax-worker":
        assert ctx.params["hostname"] == POD_NAME
        parse_queues(configmap_data()["AX_WORKER_QUEUES"], from_env(configmap_data()))


def probe_port(c: dict[str, Any], probe: dict[str, Any]) -> int:
    port = probe["httpGet"]["port"]
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
    assert isinstance(number, int)
    return number


@pytest.mark.parametrize("kind,name,port_flag,addr_flag", [
    ("StatefulSet", "ax-scheduler", "--metrics-port", "--metrics-addr"),
    ("StatefulSet", "ax-worker", "--metrics-port", "--metrics-addr"),
    ("Deployment", "ax-web", "--port", "--bind"),
])
def test_probes_hit_healthz_and_readyz_where_the_process_serves(
        kind: str, name: str, port_flag: str, addr_flag: str) -> None:
    c = container(one(kind, name))
    argv = argv_of(c)
    port = option(argv, port_flag)
    assert port is not None and int(port) > 0
    assert option(argv, addr_flag) == "0.0.0.0", "the kubelet probes the pod's address"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    probes = [c[k] for k in ("livenessProbe", "readinessProbe", "startupProbe") if k in c]
    assert {probe_port(c, p) for p in probes} == {int(port)}


def test_a_worker_pod_outlives_its_warm_stop() -> None:
    """KILL comes after terminationGracePeriodSeconds: it must exceed the time running tasks
    get to finish (the code's default, or the ConfigMap's AX_WORKER_GRACE_S)."""
    default = WorkerSettings().worker_grace_s
    configured = from_env(configmap_data()).worker_grace_s
    period = one("StatefulSet", "ax-worker")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]
    assert period > max(default, configured)
    assert period >= configured + 15, "room for writing the results and handing runs back"


def test_the_configmap_says_only_what_ax_reads() -> None:
    data = configmap_data()
    assert set(data) <= ax_envvars(), set(data) - ax_envvars()
    from_env(data)  # and its values are valid settings


def test_every_pod_runs_as_the_images_user_and_finds_its_secrets() -> None:
    uid = int(image_uid())
    secret_keys = set(one("Secret", "ax-secrets")["stringData"])
    workloads = [m for m in manifests() if m["kind"] in ("StatefulSet", "Deployment", "Job")]
    assert len(workloads) == 4
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == uid
        c = container(workload)
        parse(argv_of(c))
        refs = {e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"]
                if "secretKeyRef" in e.get("valueFrom", {})}
        assert "AX_DATABASE_URL" in refs and refs <= secret_keys
        for source in c.get("envFrom", []):
            assert one("ConfigMap", source["configMapRef"]["name"])
        if c["securityContext"].get("readOnlyRootFilesystem"):
            writable = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert workload["kind"] == "Job" or "/tmp" in writable, workload["metadata"]["name"]
    web = container(one("Deployment", "ax-web"))
    assert any(e["name"] == "AX_WEB_TOKEN" for e in web["env"])


def test_the_migration_job_upgrades_the_schema() -> None:
    assert argv_of(container(one("Job", "ax-migrate"))) == ["ax", "db", "upgrade"]


def test_disruption_budgets_select_the_daemons() -> None:
    budgets = {m["metadata"]["name"]: m["spec"] for m in manifests()
               if m["kind"] == "PodDisruptionBudget"}
    assert set(budgets) == {"ax-scheduler", "ax-worker"}
    for name, spec in budgets.items():
        labels = one("StatefulSet", name)["spec"]["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert budgets["ax-scheduler"]["minAvailable"] == 1
    assert one("StatefulSet", "ax-scheduler")["spec"]["replicas"] >= 2


def test_services_route_to_the_named_ports() -> None:
    for manifest in manifests():
        if manifest["kind"] != "Service":
            continue
        name = manifest["metadata"]["name"]
        workload = next(m for m in manifests() if m["kind"] in ("StatefulSet", "Deployment")
                        and m["metadata"]["name"] == name)
        assert manifest["spec"]["selector"].items() <= \
            workload["spec"]["template"]["metadata"]["labels"].items()
        names = {p["name"] for p in container(workload)["ports"]}
        assert {p["targetPort"] for p in manifest["spec"]["ports"]} <= names
