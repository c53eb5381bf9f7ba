"""``ax-worker --processes N``: one supervisor process, N worker processes under it.

A worker is one Python process, and a CPU-bound processor holds its GIL; a
second process is a second core. The supervisor runs no tasks and opens no
connection: it starts each child as a fresh interpreter running the worker's
own entry point (never ``os.fork`` of a process with connections), restarts
the ones that die, forwards stop requests, and serves the children's metrics
as one endpoint. Contracts:

* **Names.** Child *i* (1..N) of a supervisor named ``NAME`` is the node
  ``NAME.i`` (:func:`child_name`): each child registers, heartbeats, is judged
  dead and is recovered as its own node, exactly like a standalone worker. A
  child restarted after it died gets the same name, so its registration (a new
  incarnation) takes over at once what the dead one was running (retried, or
  FAILED "worker lost"); the old incarnation's starts stay fenced.
* **Stops.** A child takes its stop orders from the supervisor, over its stdin
  pipe: a line ``warm`` or ``cold`` (:func:`obey_supervisor`). It ignores
  SIGTERM and SIGINT, so a service manager signalling every process of the
  unit, or Ctrl-C reaching the terminal's process group, cannot turn the warm
  stop the supervisor forwards into a cold one; SIGQUIT to a child is still a
  cold stop of that child. End of file on the pipe (the supervisor is gone,
  even ``kill -9``) is a warm stop. The supervisor's first SIGTERM/SIGINT sends
  ``warm`` to every child, a second one or SIGQUIT sends ``cold``; it waits for
  every child, and exits 0 after a warm stop, 1 after a cold one, as a
  standalone worker does.
* **Quiet.** SIGTSTP to the supervisor sends ``quiet`` to every child running then
  (:mod:`ax_kombu.worker.quiet`: each stops taking work and stores its quiet, so ``ax
  workers`` shows it); a child also takes SIGTSTP itself. ``ax workers quiet NAME`` and
  ``resume NAME`` with the supervisor's name act on its children ``NAME.1`` …
  ``NAME.N`` through their rows. A child started later (a restart) starts consuming.
* **No secret on a command line.** A child's argv repeats the flags given to the
  supervisor except the connection URLs, which it gets as ``AX_DATABASE_URL`` and
  ``AX_BROKER_URL`` in its environment (:func:`ax_kombu.cli.worker.child_env`):
  ``ps`` shows every user the argv of every process, not its environment.
* **Restarts.** A child that exits while no stop was requested (crashed, killed)
  is started again under its name after a back-off: :data:`RESTART_BASE_S`,
  doubled for each exit that follows a run shorter than :data:`STABLE_S`, at
  most :data:`RESTART_CAP_S` (:func:`restart_delay_s`). Each exit and restart
  is logged.
* **Metrics.** With a metrics port, the children run prometheus_client in its
  multiprocess mode in a fresh directory (:class:`SharedMetrics`) and the
  supervisor serves their sum on one endpoint: counters and histograms add up
  over every child that ever ran (a restarted child's counts are kept), gauges
  follow the ``multiprocess_mode`` given in :mod:`ax_kombu.observability.metrics`
  and a dead child's live gauges are dropped. The directory is removed at exit.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any

from ax_kombu.observability.probes import REPORTS_ENV, Probe
from ax_kombu.worker.control import StopFlags

log = logging.getLogger(__name__)

#: how long the first restart of a child waits
RESTART_BASE_S = 1.0
#: the longest wait before a restart, however often a child crashed
RESTART_CAP_S = 30.0
#: a child that ran at least this long before it exited counts as stable: no back-off grows
STABLE_S = 60.0
#: how often the supervisor looks at its children and its stop flags
POLL_S = 0.1
#: the lines a child reads on its stdin
WARM, COLD, QUIET = b"warm\n", b"cold\n", b"quiet\n"


def child_name(base: str, index: int) -> str:
    """The node name of child ``index`` (1-based) of the supervisor named ``base``."""
    return f"{base}.{index}"


def restart_delay_s(quick_exits: int) -> float:
    """The wait before restarting a child after its ``quick_exits``-th exit in a row that
    followed a run shorter than :data:`STABLE_S` (0: it had run stably)."""
    return min(RESTART_CAP_S, RESTART_BASE_S * 2.0 ** max(0, quick_exits - 1))


def describe_exit(code: int) -> str:
    """``"exit 70"`` or ``"SIGKILL"`` for a :attr:`subprocess.Popen.returncode`."""
    if code >= 0:
        return f"exit {code}"
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


@dataclass
class Child:
    """One child slot: its name, the process now in it (None between runs), its back-off."""

    index: int
    name: str
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    quick_exits: int = 0
    restart_at: float | None = None


class Supervisor:
    """Keeps ``count`` worker processes running until stopped; see the module docstring.

    Args:
        command: the command line of the child named by its argument.
        base: the supervisor's node name; the children are ``base.1`` … ``base.N``.
        count: how many children.
        env: the children's environment.
        on_exit: called with the pid of each child that exited (after it was reaped).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, command: Callable[[str], list[str]], base: str, count: int, *,
                 env: Mapping[str, str] | None = None,
                 on_exit: Callable[[int], None] = lambda pid: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._command = command
        self._env = dict(env) if env is not None else None
        self._on_exit = on_exit
        self._clock = clock
        self.children = [Child(i, child_name(base, i)) for i in range(1, count + 1)]
        self.flags = StopFlags()
        self._sent: bytes | None = None
        #: SIGTSTP asked for quiet and the children were not told yet
        self._quiet_asked = False

    def request_stop(self, cold: bool = False) -> None:
        """Warm stop; cold if ``cold`` or if a stop was already requested. Only sets flags
        (safe from a signal handler); the supervisor's loop forwards it."""
        self.flags.request(cold)

    def request_quiet(self) -> None:
        """Have every child running go quiet. Only sets a flag (safe from a signal handler);
        the supervisor's loop forwards it."""
        self._quiet_asked = True

    def run(self) -> int:
        """Start the children and supervise them until they all stopped after a stop request.

        Returns:
            0 after a warm stop, 1 after a cold one.
        """
        for child in self.children:
            self._start(child)
        while True:
            self._forward_quiet()
            self._forward_stop()
            self._reap()
            if self.flags.stopping:
                if all(child.proc is None for child in self.children):
                    break
            else:
                self._restart_due()
            time.sleep(POLL_S)
        log.info("worker processes stopped", extra={"cold": self.flags.cold})
        return 1 if self.flags.cold else 0

    def _start(self, child: Child) -> None:
        child.proc = subprocess.Popen(self._command(child.name), stdin=subprocess.PIPE,
                                      env=self._env, process_group=0)
        child.started, child.restart_at = self._clock(), None
        log.info("worker process started", extra={"node": child.name, "pid": child.proc.pid})

    def _forward_stop(self) -> None:
        """Send the stop requested (once per level) to every child running."""
        if not self.flags.stopping:
            return
        order = COLD if self.flags.cold else WARM
        if self._sent == order or self._sent == COLD:
            return
        self._sent = order
        log.info("stopping the worker processes", extra={"cold": self.flags.cold})
        for child in self.children:
            if child.proc is not None:
                _tell(child.proc, order)

    def _forward_quiet(self) -> None:
        """Send ``quiet`` to every child running, once per request."""
        if not self._quiet_asked or self.flags.stopping:
            return
        self._quiet_asked = False
        log.info("asking the worker processes to be quiet")
        for child in self.children:
            if child.proc is not None:
                _tell(child.proc, QUIET)

    def _reap(self) -> None:
        for child in self.children:
            proc = child.proc
            if proc is None or proc.poll() is None:
                continue
            child.proc = None
            if proc.stdin is not None:
                _close_quietly(proc.stdin)
            self._on_exit(proc.pid)
            if self.flags.stopping:
                log.info("worker process exited", extra={"node": child.name, "pid": proc.pid,
                                                         "status": describe_exit(proc.returncode)})
                continue
            self._schedule_restart(child, proc)

    def _schedule_restart(self, child: Child, proc: subprocess.Popen[bytes]) -> None:
        now = self._clock()
        child.quick_exits = 0 if now - child.started >= STABLE_S else child.quick_exits + 1
        delay = restart_delay_s(child.quick_exits)
        child.restart_at = now + delay
        log.warning("worker process exited unexpectedly; restarting it",
                    extra={"node": child.name, "pid": proc.pid,
                           "status": describe_exit(proc.returncode),
                           "ran_s": round(now - child.started, 1), "restart_in_s": delay})

    def _restart_due(self) -> None:
        now = self._clock()
        for child in self.children:
            if child.proc is None and child.restart_at is not None and now >= child.restart_at:
                self._start(child)


def _tell(proc: subprocess.Popen[bytes], order: bytes) -> None:
    """Write a stop order to a child's stdin; a child that is gone is reaped later."""
    if proc.stdin is None:
        return
    try:
        proc.stdin.write(order)
        proc.stdin.flush()
    except (OSError, ValueError):
        pass


def _close_quietly(stream: IO[bytes]) -> None:
    try:
        stream.close()
    except OSError:
        pass


# -- the child's side ---------------------------------------------------------------------------


def obey_supervisor(request_stop: Callable[[bool], None], stopping: Callable[[], bool],
                    fd: int = 0, request_quiet: Callable[[], None] | None = None
                    ) -> threading.Thread:
    """Make this worker process a supervisor's child: stop orders come on ``fd`` (stdin).

    SIGTERM and SIGINT are ignored (the supervisor forwards them), SIGQUIT is
    a cold stop; a thread reads ``warm`` / ``cold`` lines (and ``quiet``: calls
    ``request_quiet``), and takes end of
    file (the supervisor is gone) as a warm stop. A warm order while a stop is
    already under way changes nothing. The thread reads the descriptor with
    ``os.read``, not through ``sys.stdin``: a daemon thread blocked inside a
    buffered reader holds its lock, which aborts the interpreter at exit.
    Call it from the main thread.

    Returns:
        The reading thread (a daemon).
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, lambda _sig, _frame: request_stop(True))

    def read() -> None:
        pending = b""
        while chunk := _read(fd):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line == COLD.strip():
                    request_stop(True)
                elif line == WARM.strip() and not stopping():
                    request_stop(False)
                elif line == QUIET.strip() and request_quiet is not None:
                    request_quiet()
        if not stopping():
            log.warning("the supervisor's pipe closed; stopping warmly")
            request_stop(False)

    thread = threading.Thread(target=read, name="ax-supervisor-pipe", daemon=True)
    thread.start()
    return thread


def _read(fd: int) -> bytes:
    """The next bytes on ``fd``; empty at end of file (or if it cannot be read)."""
    try:
        return os.read(fd, 512)
    except OSError:
        return b""


# -- metrics ------------------------------------------------------------------------------------


class SharedMetrics:
    """prometheus_client's multiprocess mode for the children, one endpoint for all of them.

    The directory exists from construction to :meth:`close`; each child gets it as
    ``PROMETHEUS_MULTIPROC_DIR`` (:attr:`env`) before it imports prometheus_client.
    """

    VARIABLE = "PROMETHEUS_MULTIPROC_DIR"

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="ax-worker-metrics-")
        self._server: Any = None

    @property
    def env(self) -> dict[str, str]:
        """What to add to each child's environment."""
        return {self.VARIABLE: self.path, REPORTS_ENV: self.reports}

    @property
    def reports(self) -> str:
        """Where the children write their probes' answers
        (:class:`ax_kombu.observability.probes.Reporter`), inside the directory."""
        return os.path.join(self.path, "probes")

    def serve(self, port: int, addr: str, probe: Probe | None = None) -> None:
        """Serve the children's merged metrics at ``http://addr:port/metrics``, and
        ``probe``'s ``/healthz`` and ``/readyz`` (the supervisor's checks of its children:
        :func:`ax_kombu.observability.probes.watch_reports` on :attr:`reports`)."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        from ax_kombu.observability import metrics

        os.makedirs(self.reports, exist_ok=True)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.path)  # type: ignore[no-untyped-call]
        self._server = metrics.serve(port, addr, registry, probe)

    def process_dead(self, pid: int) -> None:
        """Drop the live gauges of a child that exited (its counters stay in the sums)."""
        from prometheus_client.multiprocess import mark_process_dead

        mark_process_dead(pid, self.path)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        """Stop serving and remove the directory."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        shutil.rmtree(self.path, ignore_errors=True)


__all__ = ["Child", "SharedMetrics", "Supervisor", "child_name", "describe_exit",
           "obey_supervisor", "restart_delay_s"]
