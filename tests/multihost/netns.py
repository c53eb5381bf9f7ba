"""Hosts on this machine: one network namespace per host on a bridge (issue 24).

:class:`Hosts` builds the topology: a bridge in the root namespace with the first address
of a private /24 (``10.231.X.1``, X chosen free), and per host a namespace (lo up) with a
veth pair whose root end is a port of the bridge and whose other end carries the host's
address. Every name starts with a short per-run prefix (``axn`` and 4 hex digits), and
every link of the run carries the test process's pid in its alias, so a later run removes
what a killed earlier one left behind (:func:`remove_stale`) and never touches a live
run's. :meth:`Hosts.close` deletes the namespaces, veths and bridge.

**The cut** (:meth:`Hosts.cut`) blocks the host's port on the bridge (bridge port state
*disabled*): every frame to or from the host is dropped at the switch, silently, in both
directions, while both ends of the link stay up. That is what a pulled cable looks like to
every process on either side: sends succeed locally and nothing comes back, so TCP
retransmits with backoff, established connections stall rather than fail, and a peer
learns of the loss only from its own timeouts (ARP expiry makes new connections fail with
"no route to host" after a few seconds, as on a real LAN). A link set down would instead
fail every send on the host at once (the host would *know*); a qdisc dropping on the
host's own interface (``netem loss 100%``, ``pfifo limit 0``) reports each drop to the
sender's stack as local congestion, which a cable does not. :meth:`Hosts.heal` puts the
port back to forwarding: the stalled connections resume at their next retransmission.

**How soon after the heal.** TCP doubles its retransmission interval on every loss, up to
two minutes: after a 30 s silence a stalled connection's next try comes 20 s to a minute
or more after the heal (measured here: the cut host learned it was declared dead 25 s,
then over 60 s, after the heal). Both ends of every connection that crosses the bridge
can therefore cap that interval (``rto_max_ms``: the namespaces' ``net.ipv4.tcp_rto_max_ms``
and the forwarder's ``TCP_RTO_MAX_MS`` socket option, Linux ≥ 6.15), so the stalled
connections, and the stale requests they carry, resume within that time of the heal.

**The servers live on their own host**, the root namespace, reached at the bridge
address: a private ``redis-server`` (:class:`BridgeRedis`) and a ``socat`` forwarder to
the shared PostgreSQL (:class:`BridgeForwarder`); the namespaced daemons cannot reach the
root namespace's 127.0.0.1. :class:`HostCluster` is the fault suite's
:class:`~tests.faults.cluster.Cluster` with each daemon started inside its host's
namespace (``ip netns exec``); namespaces share the filesystem, so the ledger, the logs and
the repository are where the daemons expect them.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tests.e2e.system import Daemon, _command
from tests.faults.cluster import Cluster, NodeSpec
from tests.faults.servers import PrivateRedis, terminate, wait_port

#: every name this module creates starts with it, then 4 hex digits of the run
PREFIX = "axn"
_RUN_NAME = re.compile(rf"^{PREFIX}[0-9a-f]{{4}}")
#: the alias every link of a run carries: whose it is
_OWNER = re.compile(r"ax-test pid (\d+)")
_NETNS_OWNER = re.compile(rf"^{PREFIX}[0-9a-f]{{4}}-[a-z0-9]+-p(\d+)$")
#: bridge port states (``bridge link set ... state``)
_DISABLED, _FORWARDING = 0, 3


def ip(*args: str, namespace: str | None = None, check: bool = True) -> str:
    """Run ``ip ARGS`` (inside ``namespace`` if given); its output."""
    command = ["ip", *(("netns", "exec", namespace, "ip") if namespace else ()), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
    return done.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the namespaces and links of earlier runs whose test process is gone (by the
    pid in their name or alias); returns what was deleted."""
    removed = []
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        owner = _NETNS_OWNER.match(name)
        if owner and not _alive(int(owner.group(1))):
            ip("netns", "delete", name, check=False)
            removed.append(name)
    for line in ip("-o", "link", "show").splitlines():
        parts = line.split(":", 2)
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        if not _RUN_NAME.match(name):
            continue
        owner = _OWNER.search(line)
        if owner is None or not _alive(int(owner.group(1))):
            ip("link", "delete", name, check=False)
            removed.append(name)
    return removed


def _free_subnet() -> int:
    """X of a 10.231.X.0/24 no interface of the root namespace uses."""
    used = ip("-4", "-o", "addr", "show")
    for _ in range(50):
        x = secrets.randbelow(250) + 2
        if f" 10.231.{x}." not in used:
            return x
    raise RuntimeError("no free 10.231.X.0/24 subnet")


class Hosts:
    """Namespaces ``hosts`` on one bridge; see the module docstring. Built at once; always
    :meth:`close` it (a partly built topology is removed before the error propagates)."""

    def __init__(self, hosts: Sequence[str], rto_max_ms: int | None = None) -> None:
        self.run = f"{PREFIX}{secrets.token_hex(2)}"
        self.rto_max_ms = rto_max_ms
        #: whether the kernel took the cap (``net.ipv4.tcp_rto_max_ms``, Linux >= 6.15)
        self.rto_capped = False
        self.subnet = _free_subnet()
        self.bridge = f"{self.run}br"
        self.hosts = list(hosts)
        self.namespaces = {h: f"{self.run}-{h}-p{os.getpid()}" for h in self.hosts}
        self.ports = {h: f"{self.run}{i}r" for i, h in enumerate(self.hosts)}
        self.addresses = {h: f"10.231.{self.subnet}.{i + 2}" for i, h in enumerate(self.hosts)}
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    @property
    def bridge_address(self) -> str:
        """The servers' host (the root namespace), as every namespace reaches it."""
        return f"10.231.{self.subnet}.1"

    def _own(self, link: str) -> None:
        ip("link", "set", "dev", link, "alias", f"ax-test pid {os.getpid()}")

    def _build(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        self._own(self.bridge)
        ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts):
            namespace, port, inside = self.namespaces[host], self.ports[host], f"{self.run}{i}h"
            ip("netns", "add", namespace)
            ip("link", "add", port, "type", "veth", "peer", "name", inside)
            self._own(port)
            ip("link", "set", inside, "netns", namespace)
            ip("link", "set", port, "master", self.bridge)
            ip("link", "set", port, "up")
            ip("link", "set", "lo", "up", namespace=namespace)
            ip("addr", "add", f"{self.addresses[host]}/24", "dev", inside, namespace=namespace)
            ip("link", "set", inside, "up", namespace=namespace)
            if self.rto_max_ms is not None:
                self.rto_capped = self._cap_rto(namespace, self.rto_max_ms)

    @staticmethod
    def _cap_rto(namespace: str, rto_max_ms: int) -> bool:
        done = subprocess.run(["ip", "netns", "exec", namespace, "sysctl", "-q", "-w",
                               f"net.ipv4.tcp_rto_max_ms={rto_max_ms}"], capture_output=True,
                              timeout=30, check=False)
        return done.returncode == 0

    def exec_prefix(self, host: str) -> list[str]:
        """The command prefix that runs a program inside ``host``."""
        return ["ip", "netns", "exec", self.namespaces[host]]

    def _port_state(self, host: str, state: int) -> None:
        done = subprocess.run(["bridge", "link", "set", "dev", self.ports[host], "state",
                               str(state)], capture_output=True, text=True, timeout=30,
                              check=False)
        if done.returncode != 0:
            raise RuntimeError(f"bridge link set {self.ports[host]}: {done.stderr.strip()}")

    def cut(self, host: str) -> None:
        """Silently drop every frame to and from ``host`` (see the module docstring)."""
        self._port_state(host, _DISABLED)

    def heal(self, host: str) -> None:
        self._port_state(host, _FORWARDING)

    def is_cut(self, host: str) -> bool:
        return "state disabled" in subprocess.run(
            ["bridge", "link", "show", "dev", self.ports[host]], capture_output=True,
            text=True, timeout=30, check=False).stdout

    def close(self) -> None:
        """Delete the namespaces (their veth ends go with them, and so do the peers), the
        root ends left over, and the bridge."""
        for namespace in self.namespaces.values():
            ip("netns", "delete", namespace, check=False)
        for port in self.ports.values():
            ip("link", "delete", port, check=False)
        ip("link", "delete", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """What of this run still exists (empty after :meth:`close`)."""
        links = [n for n in (*self.ports.values(), self.bridge)
                 if subprocess.run(["ip", "link", "show", n], capture_output=True,
                                   timeout=30, check=False).returncode == 0]
        namespaces = set(ip("netns", "list").split())
        return links + [n for n in self.namespaces.values() if n in namespaces]


def free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


class BridgeRedis(PrivateRedis):
    """A :class:`~tests.faults.servers.PrivateRedis` listening on the bridge address too
    (and on loopback, where the test's own checks reach it)."""

    def __init__(self, tmp: Path, address: str) -> None:
        super().__init__(tmp)
        self.address = address
        self.bind = ("127.0.0.1", address)

    @property
    def url(self) -> str:
        return f"redis://{self.address}:{self.port}/0"


#: the ``TCP_RTO_MAX_MS`` socket option (Linux >= 6.15; an accepted socket inherits it)
TCP_RTO_MAX_MS = 44


class BridgeForwarder:
    """``socat`` on ``address``:random → ``target`` (one child per connection), in its
    own process group, which :meth:`close` kills whole; its connections' retransmission
    interval capped at ``rto_max_ms`` if given."""

    def __init__(self, socat: str, address: str, target: tuple[str, int], log: Path,
                 rto_max_ms: int | None = None) -> None:
        self.address, self.port = address, free_port(address)
        cap = f",setsockopt-int=6:{TCP_RTO_MAX_MS}:{rto_max_ms}" if rto_max_ms else ""
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [socat, f"TCP-LISTEN:{self.port},bind={address},reuseaddr,fork,backlog=256{cap}",
                 f"TCP:{target[0]}:{target[1]}"], stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        if not wait_port(self.port, 10, address, 0.05):
            self.close()
            raise RuntimeError(f"socat did not listen on {address}:{self.port}")

    def url(self, database_url: str) -> str:
        """``database_url`` with its host and port replaced by the forwarder's."""
        parts = urlsplit(database_url)
        user = parts.netloc.rpartition("@")[0]
        return parts._replace(netloc=(user + "@" if user else "")
                              + f"{self.address}:{self.port}").geturl()

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        terminate(self.proc, 5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class HostCluster(Cluster):
    """A :class:`~tests.faults.cluster.Cluster` whose daemons each run inside their host's
    namespace (``placement``: node name -> host of ``hosts``), reaching the store and the
    broker at the bridge address (``daemon_database_url`` and the broker settings)."""

    def __init__(self, database_url: str, broker: Mapping[str, str], tmp: Path,
                 hosts: Hosts, placement: Mapping[str, str], *,
                 daemon_database_url: str, env: Mapping[str, Any] | None = None) -> None:
        super().__init__(database_url, broker, tmp, env, daemon_database_url)
        self.hosts = hosts
        self.placement = dict(placement)

    def on_host(self, host: str) -> list[str]:
        return [n for n, h in self.placement.items() if h == host]

    def start(self, name: str, kind: str | None = None, args: Sequence[str] = (),
              ax: Mapping[str, Any] | None = None, raw: Mapping[str, str] | None = None
              ) -> Daemon:
        """Start node ``name`` inside its host (as :meth:`Cluster.start` does on this one);
        ``ip netns exec`` execs the daemon, so the process is the daemon's own pid."""
        spec = self.specs[name] if kind is None else NodeSpec(kind, list(args), dict(ax or {}),
                                                                 dict(raw or {}))
        self.specs[name] = spec
        env = {**self.daemon_env(spec.ax), "FAULT_NODE": name, **spec.raw}
        log = self.tmp / f"{name}.log"
        command = [*self.hosts.exec_prefix(self.placement[name]), *_command(spec.kind),
                   "-n", name, "-l", "INFO", *spec.args]
        with open(log, "ab") as out:
            proc = subprocess.Popen(command, cwd=self.tmp, env=env, stdout=out,
                                    stderr=subprocess.STDOUT)
        daemon = Daemon(name, spec.kind, proc, log)
        self.daemons.append(daemon)
        self.pids[name].append(proc.pid)
        return daemon
