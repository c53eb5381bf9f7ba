"""Servers of the test's own on free loopback ports, which a scenario may stop and start
again: :class:`PrivateRedis` and :class:`PrivateRabbit`. The shared servers the rest of
the suite uses are never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from tests.e2e.system import stop_all

from ..waiting import wait_until


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def terminate(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; always reaps."""
    stop_all([proc], grace_s)


def wait_port(port: int, timeout: float, host: str = "127.0.0.1",
              interval: float = 0.1) -> bool:
    """Until a TCP connection to ``host:port`` succeeds, at most ``timeout`` s."""
    def check() -> bool:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
        except OSError:
            return False
        return True
    return bool(wait_until(check, timeout, interval))


class PrivateRedis:
    """A redis-server of the test's own on a free loopback port, without persistence
    (a restart loses whatever it kept); listening on the addresses of :attr:`bind`."""

    def __init__(self, tmp: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found")
        self.binary, self.tmp, self.port = binary, tmp, free_port()
        #: the addresses it listens on (more than loopback: protected mode off)
        self.bind: tuple[str, ...] = ("127.0.0.1",)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = open(self.tmp / "redis.log", "ab")  # noqa: SIM115 - lives with the process
        unprotected = ["--protected-mode", "no"] if len(self.bind) > 1 else []
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", *self.bind, *unprotected,
             "--save", "", "--appendonly", "no", "--dir", str(self.tmp)], stdout=log, stderr=log)
        log.close()
        if not wait_port(self.port, 15, self.bind[-1]):
            raise RuntimeError(f"private redis-server did not listen on {self.url}")

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 10)
            self.proc = None


class PrivateRabbit:
    """A RabbitMQ node of the test's own (own node name, loopback ports, data dir and
    cookie), started from ``/usr/lib/rabbitmq/bin``; the shared server is never touched."""

    BIN = Path("/usr/lib/rabbitmq/bin")

    def __init__(self, tmp: Path) -> None:
        if not (self.BIN / "rabbitmq-server").exists():
            raise RuntimeError(f"{self.BIN}/rabbitmq-server not found")
        self.tmp = tmp
        self.port, self.dist_port = free_port(), free_port()
        self.node = f"axfault{os.getpid()}x{self.port}@localhost"
        (tmp / "rabbit.conf").write_text(f"listeners.tcp.local = 127.0.0.1:{self.port}\n"
                                         "loopback_users.guest = true\n")
        (tmp / "plugins").write_text("[].\n")
        self.env = {**os.environ, "HOME": str(tmp), "RABBITMQ_NODENAME": self.node,
                    "RABBITMQ_CONF_ENV_FILE": "/dev/null",
                    "RABBITMQ_CONFIG_FILE": str(tmp / "rabbit.conf"),
                    "RABBITMQ_MNESIA_BASE": str(tmp / "mnesia"),
                    "RABBITMQ_LOG_BASE": str(tmp / "rabbit-log"),
                    "RABBITMQ_ENABLED_PLUGINS_FILE": str(tmp / "plugins"),
                    "RABBITMQ_DIST_PORT": str(self.dist_port),
                    "RABBITMQ_PID_FILE": str(tmp / "rabbit.pid"),
                    "ERL_EPMD_ADDRESS": "127.0.0.1",
                    "ERL_FLAGS": "-kernel inet_dist_use_interface {127,0,0,1}"}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self, timeout: float = 60) -> None:
        log = open(self.tmp / "rabbit.out", "ab")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen([str(self.BIN / "rabbitmq-server")], env=self.env,
                                     stdout=log, stderr=log, start_new_session=True)
        log.close()
        if not wait_port(self.port, timeout):
            raise RuntimeError(f"private RabbitMQ did not listen on {self.port} within "
                               f"{timeout:g} s")

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.BIN / "rabbitmqctl"), "-n", self.node, *args],
                              env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=False)

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.ctl("stop", timeout=30)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

