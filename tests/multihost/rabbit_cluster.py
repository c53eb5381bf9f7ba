"""A RabbitMQ cluster of the test's own: three private nodes (issue 24).

Each node is a :class:`~tests.faults.servers.PrivateRabbit` (its own node name, AMQP
port, distribution port on 127.0.0.1, data and log directories under the test's
``tmp_path``), all sharing one Erlang cookie. The nodes start in parallel; nodes 2 and 3
then ``stop_app``, ``reset``, ``join_cluster`` node 1 and ``start_app``, and a vhost is
created for the test. :meth:`RabbitCluster.stop` always stops every node and SIGKILLs
whatever is left of each node's process group. The shared server is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from tests.faults.servers import PrivateRabbit

T = TypeVar("T")


class ClusterNode(PrivateRabbit):
    """One node of a :class:`RabbitCluster`: a private node with the cluster's cookie."""

    def __init__(self, tmp: Path, cookie: str) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        super().__init__(tmp)
        # the Erlang VM and the CLI tools read $HOME/.erlang.cookie (HOME is ``tmp``)
        path = tmp / ".erlang.cookie"
        path.write_text(cookie)
        path.chmod(0o400)

    def url_for(self, vhost: str) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/{vhost}"

    def must(self, *args: str, timeout: float = 60) -> str:
        """``rabbitmqctl args`` on this node; its output, or RuntimeError."""
        done = self.ctl(*args, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} on {self.node}: "
                               f"{(done.stderr or done.stdout).strip()}")
        return done.stdout

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the node's whole process group (the Erlang VM and its helpers)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        """Stop the node (``rabbitmqctl stop``, SIGKILL if it hangs), then SIGKILL what is
        left of its process group."""
        pid = None if self.proc is None else self.proc.pid
        try:
            if self.alive:
                super().stop()
        finally:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            if self.proc is not None:
                self.proc.wait(10)
            self.proc = None


class RabbitCluster:
    """Three (``size``) private RabbitMQ nodes clustered on loopback, and a vhost.

    Args:
        tmp: each node's files go to ``tmp/node<i>``.
        vhost: created once the cluster has formed, with guest's permissions.
    """

    def __init__(self, tmp: Path, size: int = 3, vhost: str = "ax") -> None:
        cookie = secrets.token_hex(16).upper()
        self.nodes = [ClusterNode(tmp / f"node{i + 1}", cookie) for i in range(size)]
        self.vhost = vhost

    @property
    def url(self) -> str:
        """Kombu's failover list: node 1 first, then the others."""
        return ";".join(node.url_for(self.vhost) for node in self.nodes)

    def start(self, timeout: float = 60) -> None:
        """Start every node (in parallel), cluster nodes 2.. onto node 1, create the vhost.

        Raises:
            RuntimeError: a node did not start, or a clustering step failed.
        """
        first, *others = self.nodes
        _each(self.nodes, lambda node: node.start(timeout))
        _each(self.nodes, lambda node: node.must("await_startup", timeout=timeout))
        for node in others:  # one join at a time: each changes node 1's membership
            node.must("stop_app")
            node.must("reset")
            node.must("join_cluster", first.node)
            node.must("start_app", timeout=timeout)
        running = self.running_nodes(first)
        if running != {n.node for n in self.nodes}:
            raise RuntimeError(f"the cluster formed with {sorted(running)} only")
        first.must("add_vhost", self.vhost)
        first.must("set_permissions", "-p", self.vhost, "guest", ".*", ".*", ".*")

    def running_nodes(self, asked: ClusterNode) -> set[str]:
        """The nodes ``asked`` sees running (``cluster_status``)."""
        out = asked.must("cluster_status", "--formatter", "json")
        return set(json.loads(out)["running_nodes"])

    def stop(self) -> None:
        """Stop every node, in parallel; each one's process group is killed in the end."""
        _each(self.nodes, ClusterNode.stop, raise_first=False)


def _each(nodes: Sequence[ClusterNode], action: Callable[[ClusterNode], T],
          raise_first: bool = True) -> list[T]:
    """``action`` on every node at once; the first error is raised once all are done."""
    with ThreadPoolExecutor(len(nodes)) as pool:
        futures = [pool.submit(action, node) for node in nodes]
    errors = [e for f in futures if (e := f.exception()) is not None]
    if errors and raise_first:
        raise errors[0]
    return [f.result() for f in futures if f.exception() is None]
