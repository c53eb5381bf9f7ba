"""The systemd units in deploy/systemd/ (issue 24): systemd's own checker accepts them, and
the command line each one runs starts its daemon on this machine, which then stops cleanly
on the unit's stop signal.

The units name ``/opt/ax/venv``, a user ``ax`` and ``/etc/ax/ax.env``; here they are copied
with this venv's scripts, no user and an environment file of the test's own (the embedded
SQLite store and broker in a temporary directory). ``systemd-analyze`` comes with systemd:
where it is missing, that test is skipped and says so (no server is involved)."""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from sqlalchemy import select

from ax_kombu.config import from_env
from ax_kombu.store import Store
from ax_kombu.store.schema import nodes

from ..waiting import wait_until
from .system import REPO, stop_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

UNITS = REPO / "deploy" / "systemd"
#: where the units expect the venv
UNIT_VENV = "/opt/ax/venv/bin/"
#: the unit files and the instance name each is tried under (templates need one)
NAMES = {"ax-scheduler@.service": "ax-scheduler@s1.service",
         "ax-worker@.service": "ax-worker@w1.service", "ax-web.service": "ax-web.service"}


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep their case
    parser.read(UNITS / name)
    return parser


def _env_file(tmp: Path) -> dict[str, str]:
    """The example ax.env's keys, with this test's values for the stores and the web port."""
    values = dict(line.split("=", 1) for line in (UNITS / "ax.env").read_text().splitlines()
                  if line and not line.startswith("#"))
    values.update({"AX_DATABASE_URL": f"sqlite:///{tmp / 'ax.db'}",
                   "AX_BROKER_URL": f"ax+sqlite:///{tmp / 'broker.db'}",
                   "AX_METRICS_ADDR": "127.0.0.1", "AX_METRICS_PORT": "0",
                   "AX_WORKER_ARGS": "-Q high,default,slow --processes 1",
                   "AX_WEB_PORT": str(_free_port())})
    return values


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _local(text: str) -> str:
    return text.replace(UNIT_VENV, str(Path(sys.executable).parent) + "/")


def test_every_unit_names_a_command_this_package_installs() -> None:
    scripts = set(re.findall(r"^(ax[-\w]*) = ", (REPO / "pyproject.toml").read_text(), re.MULTILINE))
    for name in NAMES:
        service = _unit(name)["Service"]
        command = shlex.split(service["ExecStart"])[0]
        assert command.startswith(UNIT_VENV) and command[len(UNIT_VENV):] in scripts, command
        assert service["EnvironmentFile"] == "/etc/ax/ax.env"
        assert service.get("KillSignal", "SIGTERM") == "SIGTERM"  # the daemons' warm stop


def test_systemd_analyze_verifies_the_units(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (systemd's checker)")
    env = tmp_path / "ax.env"
    env.write_text("".join(f"{k}={v}\n" for k, v in _env_file(tmp_path).items()))
    files = []
    for name, instance in NAMES.items():
        text = _local((UNITS / name).read_text()).replace("/etc/ax/ax.env", str(env))
        text = re.sub(r"^(User|Group)=.*\n", "", text, flags=re.MULTILINE)  # no user ax here
        (tmp_path / instance).write_text(text)
        files.append(str(tmp_path / instance))
    done = subprocess.run([analyze, "verify", "--man=no", *files], capture_output=True,
                          text=True, timeout=60, check=False)
    about_ours = [line for line in (done.stdout + done.stderr).splitlines()
                  if any(instance in line for instance in NAMES.values())]
    assert done.returncode == 0 and not about_ours, done.stdout + done.stderr


def _command(name: str, instance: str, env: dict[str, str]) -> list[str]:
    """The unit's ExecStart as systemd would run it: ``%i`` and ``$VAR`` (split on
    whitespace) replaced."""
    line = _local(_unit(name)["Service"]["ExecStart"]).replace("%i", instance)
    argv: list[str] = []
    for word in shlex.split(line):
        argv += env.get(word[1:], "").split() if word.startswith("$") else [word]
    return argv


def _registered(tmp: Path, node: str) -> bool:
    store = Store(from_env({}, database_url=f"sqlite:///{tmp / 'ax.db'}"))
    try:
        with store.engine.connect() as conn:
            return conn.execute(select(nodes.c.node_id).where(
                nodes.c.node_id == node, nodes.c.stopped_at.is_(None))).first() is not None
    except Exception:  # noqa: BLE001 - the schema may not be there yet
        return False
    finally:
        store.close()


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as reply:
            return bool(reply.status)
    except urllib.error.HTTPError:
        return True  # it answered (a login page or a redirect)
    except OSError:
        return False


def test_each_unit_starts_its_daemon_and_stops_it_warm(tmp_path: Path) -> None:
    values = _env_file(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AX_")} | values
    subprocess.run([str(Path(sys.executable).parent / "ax"), "db", "upgrade"], env=env,
                   cwd=tmp_path, check=True, timeout=60, capture_output=True)
    started: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, node in (("ax-scheduler@.service", "s1"), ("ax-worker@.service", "w1"),
                           ("ax-web.service", "")):
            log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - lives with the process
            started[name] = subprocess.Popen(_command(name, node, values), env=env, cwd=tmp_path,
                                             stdout=log, stderr=subprocess.STDOUT)
        ready = {"ax-scheduler@.service": lambda: _registered(tmp_path, "s1"),
                 "ax-worker@.service": lambda: _registered(tmp_path, "w1"),
                 "ax-web.service": lambda: _answers(int(values["AX_WEB_PORT"]))}
        waiting = set(ready)

        def all_ready() -> bool:
            waiting.difference_update({n for n in waiting if ready[n]()})
            dead = {n: p.returncode for n, p in started.items() if p.poll() is not None}
            assert not dead, (dead, {n: (tmp_path / f"{n}.log").read_text()[-2000:] for n in dead})
            return not waiting
        wait_until(all_ready, 45, 0.2)
        assert not waiting, {n: (tmp_path / f"{n}.log").read_text()[-2000:] for n in waiting}
        for name, proc in started.items():  # the unit's KillSignal, then its exit
            proc.send_signal(signal.SIGTERM)
            timeout = float(_unit(name)["Service"].get("TimeoutStopSec", "90"))
            # the daemons exit 0 after a warm stop; uvicorn (ax web) ends by the signal it
            # caught once it has shut down, which systemd counts as a clean exit too
            clean = {0, -signal.SIGTERM} if name == "ax-web.service" else {0}
            code = proc.wait(min(timeout, 30))
            assert code in clean, (code, (tmp_path / f"{name}.log").read_text()[-2000:])
        assert not _registered(tmp_path, "s1") and not _registered(tmp_path, "w1")
    finally:
        stop_all(list(started.values()))
