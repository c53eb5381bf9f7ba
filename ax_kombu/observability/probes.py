"""Health probes: ``GET /healthz`` and ``GET /readyz`` for an orchestrator.

A daemon keeps one :class:`Probe` and registers named checks into it, each a callable
answering ``(ok, reason)``:

* **live** checks decide ``/healthz``: the process is serving and its heartbeat goes on:
  a beat was tried within the silence window, landed or not, or one is waiting on the
  database for less than :data:`HUNG_S` (:func:`watch_beats`). A process whose liveness
  fails should be restarted: a database outage is not such a case (a restart cannot
  cure it, and every node would restart at once), so it fails readiness, not liveness.
* **ready** checks decide ``/readyz``, after the live ones: registered under a live
  incarnation (its lease covers now), the database reachable (the last beat landed),
  and consuming (a worker) or claiming (a scheduler). A process that is not ready
  should get no traffic, but may recover alone.

Each probe answers 200 or 503 with one line of JSON: ``{"ok": false, "reason":
"heartbeat 4.2 s old (silence window 3 s)", "check": "heartbeat"}``: the reasons of the
checks that failed, and the name of the first of them in the order registered (all
passed: their reasons, and no name). A check that raises fails with its exception's text. Checks read what the daemon already keeps in
memory (no database round trip), so a probe answers at once even while the database hangs.

Under ``ax-worker --processes N`` the supervisor serves the port while its children
beat: each child writes its answers to a file every interval (:class:`Reporter`), and
the supervisor's checks read them (:func:`watch_reports`): it is healthy while every
child reported within the silence window that it is live, and ready while every child is.

:func:`wsgi_app` routes the two paths to a probe and everything else to another WSGI
application (the Prometheus metrics, :func:`ax_kombu.observability.metrics.serve`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

#: a check: ``(ok, reason)``, the reason one short line
Check = Callable[[], tuple[bool, str]]
#: a WSGI application (PEP 3333)
WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
#: the variable naming the directory where a supervisor's children write their answers
REPORTS_ENV = "AX_PROBE_DIR"
PATHS = ("/healthz", "/readyz")
#: a beat waiting on the database this long means the process is wedged (not live)
HUNG_S = 60.0


@dataclass(frozen=True)
class Answer:
    """One probe's answer: ok (200) or not (503), why, and which check decided."""

    ok: bool
    reason: str
    check: str | None = None

    @property
    def status(self) -> int:
        return 200 if self.ok else 503

    def body(self) -> bytes:
        """The answer as one line of JSON, ending with a newline."""
        fields: dict[str, Any] = {"ok": self.ok, "reason": self.reason}
        if self.check is not None:
            fields["check"] = self.check
        return json.dumps(fields, ensure_ascii=False).encode() + b"\n"


class Probe:
    """The live and ready checks of one process (see the module docstring).

    Checks may be added while the probe is served; each is called on the HTTP server's
    thread, so it only reads (a flag, a time, a thread's state).
    """

    def __init__(self) -> None:
        self._live: dict[str, Check] = {}
        self._ready: dict[str, Check] = {}
        #: monotonic time of the last landed heartbeat, when one is watched (for reports)
        self.beat_at: Callable[[], float | None] = lambda: None

    def live(self, name: str, check: Check) -> None:
        """Add (or replace) a check of ``/healthz`` (and so of ``/readyz``)."""
        self._live[name] = check

    def ready(self, name: str, check: Check) -> None:
        """Add (or replace) a check of ``/readyz`` only."""
        self._ready[name] = check

    def healthz(self) -> Answer:
        return _decide(list(self._live.items()))

    def readyz(self) -> Answer:
        return _decide([*self._live.items(), *self._ready.items()])


def _decide(checks: Sequence[tuple[str, Check]]) -> Answer:
    """Ok with every reason if every check passed; else not, with the failed checks'
    reasons (a database cut off also makes the heartbeat old: both are said), named by
    the first that failed."""
    passed: list[tuple[str, str]] = []
    failed: list[tuple[str, str]] = []
    for name, check in checks:
        try:
            ok, reason = check()
        except Exception as exc:  # noqa: BLE001 (a broken check is a failed one, never a 500)
            ok, reason = False, f"{name}: {type(exc).__name__}: {exc}"
        (passed if ok else failed).append((name, reason))
    if failed:
        return Answer(False, "; ".join(reason for _, reason in failed), failed[0][0])
    return Answer(True, "; ".join(reason for _, reason in passed if reason) or "serving")


# -- the checks a node registers -----------------------------------------------------------


class _Lease(Protocol):
    def valid(self) -> bool: ...


class Beating(Protocol):
    """What :func:`watch_beats` reads of a node's lifecycle
    (:class:`ax_kombu.node.lifecycle.NodeLifecycle`)."""

    @property
    def landed_at(self) -> float | None: ...

    @property
    def failure(self) -> str | None: ...

    @property
    def tried_at(self) -> float | None: ...

    @property
    def trying(self) -> bool: ...

    @property
    def incarnation(self) -> int: ...

    @property
    def lease(self) -> _Lease: ...


def watch_beats(probe: Probe, node: Beating, silence_s: float,
                clock: Callable[[], float] = time.monotonic) -> None:
    """Add a node's heartbeat checks to ``probe``: live while its beats go on (see the module
    docstring); ready while its lease covers its incarnation and its last beat did not fail
    (the database is reachable)."""
    probe.beat_at = lambda: node.tried_at
    probe.live("heartbeat", lambda: beats_going(node, silence_s, clock()))
    probe.ready("registered", lambda: _registered(node))
    probe.ready("database", lambda: (node.failure is None, _database(node.failure)))


def beats_going(node: Beating, silence_s: float, now: float) -> tuple[bool, str]:
    """Is ``node``'s heartbeat going on at ``now``: a beat tried within ``silence_s``, or
    one waiting on the database for less than :data:`HUNG_S`? (Landed or not: a beat that
    fails for an unreachable database still shows the process is alive.)"""
    tried, landed = node.tried_at, node.landed_at
    if tried is None or landed is None:  # a beat must have landed once
        return False, "not registered yet"
    waited = max(0.0, now - tried)
    if node.trying:
        if waited >= HUNG_S:
            return False, f"a heartbeat has waited {waited:.1f} s on the database"
    elif waited >= silence_s:
        return False, f"no heartbeat tried for {waited:.1f} s (silence window {silence_s:g} s)"
    if node.failure is None:
        return True, f"heartbeat {max(0.0, now - landed):.1f} s old"
    return True, f"heartbeats going on, failing: {node.failure}"


def _registered(node: Beating) -> tuple[bool, str]:
    if node.incarnation == 0:
        return False, "not registered yet"
    if not node.lease.valid():
        return False, f"the lease of incarnation {node.incarnation} has run out"
    return True, f"incarnation {node.incarnation}"


def _database(failure: str | None) -> str:
    return "database reachable" if failure is None else f"database unreachable: {failure}"


# -- a supervisor's children ------------------------------------------------------------------


class Reporter(threading.Thread):
    """Writes ``probe``'s answers to ``directory/name.json`` every ``interval_s`` (a child
    of a supervisor; :func:`watch_reports` reads them). A write that fails is logged and
    tried again next interval."""

    def __init__(self, probe: Probe, directory: str, name: str, interval_s: float) -> None:
        super().__init__(name="ax-probe-report", daemon=True)
        self._probe = probe
        self._path = os.path.join(directory, f"{name}.json")
        self._interval_s = interval_s
        self._stopped = threading.Event()

    def run(self) -> None:
        while True:
            try:
                self.write()
            except OSError as exc:
                log.warning("cannot write the probe report", extra={"error": str(exc)})
            if self._stopped.wait(self._interval_s):
                return

    def stop(self) -> None:
        self._stopped.set()

    def write(self) -> None:
        """Write the answers now (atomically: readers see the old file or the new one)."""
        wall, mono = time.time(), time.monotonic()
        beat = self._probe.beat_at()
        health, ready = self._probe.healthz(), self._probe.readyz()
        report = {"at": wall, "beat_at": None if beat is None else wall - (mono - beat),
                  "healthz": [health.ok, health.reason], "readyz": [ready.ok, ready.reason]}
        temporary = f"{self._path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as out:
            json.dump(report, out)
        os.replace(temporary, self._path)


def watch_reports(probe: Probe, directory: str, names: Callable[[], Sequence[str]],
                  silence_s: float, clock: Callable[[], float] = time.time) -> None:
    """Add a supervisor's checks to ``probe``: live while every child named by ``names``
    wrote a report within ``silence_s`` that says it is live, ready while every child's
    latest report is that fresh and says it is ready."""
    def each(judge: Callable[[str, dict[str, Any], float], tuple[bool, str]]) -> Check:
        def check() -> tuple[bool, str]:
            reasons = []
            for name in names():
                ok, reason = judge(name, _report(directory, name), clock())
                if not ok:
                    return False, f"{name}: {reason}"
                reasons.append(f"{name}: {reason}")
            return True, ", ".join(reasons)
        return check

    probe.live("children", each(lambda _, report, now: _child(report, "healthz", silence_s, now)))
    probe.ready("children ready",
                each(lambda _, report, now: _child(report, "readyz", silence_s, now)))


def _report(directory: str, name: str) -> dict[str, Any]:
    """A child's latest report ({} if it has written none, or none readable)."""
    try:
        with open(os.path.join(directory, f"{name}.json"), encoding="utf-8") as answers:
            report = json.load(answers)
    except (OSError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}


def _child(report: dict[str, Any], probe: str, silence_s: float, now: float
           ) -> tuple[bool, str]:
    """A child's answer to ``probe`` ("healthz", "readyz") from its latest report, if the
    report is younger than ``silence_s`` (a child that stopped writing is not live)."""
    if not report:
        return False, "no report yet (starting)"
    age = now - float(report.get("at", 0.0))
    if age >= silence_s:
        return False, f"no report for {age:.1f} s (silence window {silence_s:g} s)"
    ok, reason = report.get(probe, [False, "no answer"])
    return bool(ok), str(reason)


# -- HTTP ----------------------------------------------------------------------------------------


def wsgi_app(probe: Probe, other: WsgiApp) -> WsgiApp:
    """``/healthz`` and ``/readyz`` (GET or HEAD) answered by ``probe``; every other path
    by ``other``."""
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in PATHS:
            return other(environ, start_response)
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"),
                                                      ("Content-Length", "0")])
            return [b""]
        answer = probe.healthz() if path == "/healthz" else probe.readyz()
        body = answer.body()
        start_response("200 OK" if answer.ok else "503 Service Unavailable",
                       [("Content-Type", "application/json"),
                        ("Content-Length", str(len(body))), ("Cache-Control", "no-store")])
        return [b""] if method == "HEAD" else [body]
    return app


__all__ = [
    "HUNG_S",
    "REPORTS_ENV",
    "Answer",
    "Beating",
    "Check",
    "Probe",
    "Reporter",
    "beats_going",
    "watch_beats",
    "watch_reports",
    "wsgi_app",
]
