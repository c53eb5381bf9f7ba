"""The probes (ax_kombu.observability.probes) and the metrics port that serves them: a
Probe's answers from its checks, a node's heartbeat checks on a fake clock, a supervisor's
checks from its children's reports, and /healthz, /readyz and /metrics over real HTTP."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from ax_kombu.core.lease import Lease
from ax_kombu.observability import metrics
from ax_kombu.observability.probes import (
    HUNG_S,
    Probe,
    Reporter,
    beats_going,
    watch_beats,
    watch_reports,
)

SILENCE_S = 3.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeNode:
    """What watch_beats reads of a NodeLifecycle."""

    lease: Lease
    landed_at: float | None = None
    failure: str | None = None
    incarnation: int = 0
    tried_at: float | None = None
    trying: bool = False

    def land(self, at: float, incarnation: int = 7) -> None:
        self.incarnation, self.landed_at, self.failure = incarnation, at, None
        self.tried_at = at
        self.lease.confirm(at, incarnation)

    def fail(self, at: float, why: str = "connection refused") -> None:
        """A beat tried at ``at`` that failed (the database unreachable)."""
        self.tried_at, self.failure = at, why


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def node(clock: Clock) -> FakeNode:
    return FakeNode(Lease(SILENCE_S - 1.0, clock))


@pytest.fixture
def probe(node: FakeNode, clock: Clock) -> Probe:
    made = Probe()
    watch_beats(made, node, SILENCE_S, clock)
    return made


def test_a_probe_without_checks_says_serving() -> None:
    assert (Probe().healthz().ok, Probe().readyz().reason) == (True, "serving")


def test_the_first_failed_check_names_the_answer_and_every_failed_reason_is_said() -> None:
    probe = Probe()
    probe.live("a", lambda: (True, "a fine"))
    probe.ready("b", lambda: (False, "b broken"))
    probe.ready("c", lambda: (False, "c broken"))
    assert probe.healthz().ok and probe.healthz().reason == "a fine"
    ready = probe.readyz()
    assert (ready.ok, ready.check, ready.reason, ready.status) == (
        False, "b", "b broken; c broken", 503)
    assert json.loads(ready.body()) == {"ok": False, "reason": "b broken; c broken",
                                        "check": "b"}
    assert ready.body().count(b"\n") == 1 and ready.body().endswith(b"\n")


def test_a_check_that_raises_fails_with_its_error() -> None:
    probe = Probe()
    probe.live("boom", lambda: (_ for _ in ()).throw(RuntimeError("no")))
    answer = probe.healthz()
    assert not answer.ok and answer.check == "boom" and "RuntimeError: no" in answer.reason


def test_before_registration_the_node_is_neither_healthy_nor_ready(probe: Probe) -> None:
    assert probe.healthz().reason == "not registered yet"
    assert not probe.readyz().ok


def test_a_fresh_beat_is_healthy_and_ready(probe: Probe, node: FakeNode, clock: Clock) -> None:
    node.land(clock.now)
    clock.now += 0.5
    assert probe.healthz().ok and probe.healthz().reason == "heartbeat 0.5 s old"
    ready = probe.readyz()
    assert ready.ok, ready
    assert "incarnation 7" in ready.reason and "database reachable" in ready.reason


def test_no_beat_tried_within_the_silence_window_is_unhealthy(
        probe: Probe, node: FakeNode, clock: Clock) -> None:
    node.land(clock.now)
    clock.now += 4.2  # the beat loop stopped (a stopped or wedged process)
    health = probe.healthz()
    assert (health.ok, health.check) == (False, "heartbeat")
    assert health.reason == "no heartbeat tried for 4.2 s (silence window 3 s)"
    ready = probe.readyz()
    assert not ready.ok and "the lease of incarnation 7 has run out" in ready.reason


def test_beats_failing_for_a_database_outage_are_unready_but_still_live(
        probe: Probe, node: FakeNode, clock: Clock) -> None:
    """A restart cures no database outage, and every node would restart at once: the
    outage fails readiness only."""
    node.land(clock.now)
    for _ in range(30):  # 30 s of failing beats, one a second
        clock.now += 1.0
        node.fail(clock.now)
    health = probe.healthz()
    assert health.ok and health.reason == "heartbeats going on, failing: connection refused"
    ready = probe.readyz()
    assert not ready.ok and "database unreachable" in ready.reason


def test_a_beat_waiting_on_the_database_is_live_until_it_hangs(
        probe: Probe, node: FakeNode, clock: Clock) -> None:
    node.land(clock.now)
    clock.now += 1.0
    node.tried_at, node.trying = clock.now, True  # a beat sent, no answer yet
    clock.now += 10.0
    assert probe.healthz().ok
    clock.now += HUNG_S
    health = probe.healthz()
    assert not health.ok and health.reason.startswith("a heartbeat has waited 70.0 s")


def test_a_failed_beat_makes_it_unready_until_one_lands(
        probe: Probe, node: FakeNode, clock: Clock) -> None:
    node.land(clock.now)
    node.failure = "connection refused"
    clock.now += 0.5
    assert probe.healthz().ok  # its last beat is still fresh
    ready = probe.readyz()
    assert (ready.ok, ready.check) == (False, "database")
    assert ready.reason == "database unreachable: connection refused"
    node.land(clock.now)
    assert probe.readyz().ok


def test_beats_going_at_the_edge(node: FakeNode) -> None:
    assert beats_going(node, 3.0, 13.0) == (False, "not registered yet")
    node.land(10.0)
    assert beats_going(node, 3.0, 12.9)[0]
    assert not beats_going(node, 3.0, 13.0)[0]


# -- a supervisor's children ---------------------------------------------------------------------


def test_a_supervisor_is_healthy_while_every_childs_reported_beat_is_fresh(
        tmp_path: Path, clock: Clock) -> None:
    children = {}
    for name in ("wp.1", "wp.2"):
        child_node = FakeNode(Lease(SILENCE_S - 1.0))
        child = Probe()
        watch_beats(child, child_node, SILENCE_S)
        children[name] = (child, child_node)
    supervisor = Probe()
    wall = Clock()
    watch_reports(supervisor, str(tmp_path), lambda: sorted(children), SILENCE_S, wall)
    assert supervisor.healthz().reason == "wp.1: no report yet (starting)"

    for name, (child, child_node) in children.items():
        child_node.land(time.monotonic())
        Reporter(child, str(tmp_path), name, 1.0).write()
    wall.now = time.time()
    assert supervisor.healthz().ok, supervisor.healthz()
    assert supervisor.readyz().ok, supervisor.readyz()

    wall.now += 4.2  # wp.1 and wp.2 wrote nothing since (stopped, say)
    health = supervisor.healthz()
    assert (health.ok, health.check) == (False, "children")
    assert health.reason.startswith("wp.1: no report for 4.2 s (silence window 3 s)")
    assert "no report for 4.2 s" in supervisor.readyz().reason

    child, child_node = children["wp.1"]
    child_node.failure = "connection refused"
    Reporter(child, str(tmp_path), "wp.1", 1.0).write()
    Reporter(children["wp.2"][0], str(tmp_path), "wp.2", 1.0).write()
    wall.now = time.time()
    assert supervisor.healthz().ok
    ready = supervisor.readyz()
    assert not ready.ok and ready.reason == "wp.1: database unreachable: connection refused"


# -- over HTTP ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def served(probe: Probe) -> Iterator[str]:
    registry = CollectorRegistry()
    Counter("ax_probe_test", "a counter only this registry has", registry=registry).inc(3)
    port = free_port()
    server = metrics.serve(port, "127.0.0.1", registry, probe)
    assert server is not None
    yield f"http://127.0.0.1:{port}"
    server.shutdown()
    server.server_close()


def get(url: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as refused:
        return refused.code, dict(refused.headers), refused.read()


def test_the_port_answers_probes_as_json_and_metrics_elsewhere(
        served: str, node: FakeNode, clock: Clock) -> None:
    status, headers, body = get(f"{served}/healthz")
    assert status == 503 and headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"ok": False, "reason": "not registered yet", "check": "heartbeat"}
    node.land(clock.now)
    for path in ("/healthz", "/readyz"):
        status, _, body = get(served + path)
        assert status == 200 and json.loads(body)["ok"] is True, body
    for path in ("/metrics", "/", "/anything"):
        status, headers, body = get(served + path)
        assert status == 200 and b"ax_probe_test_total 3.0" in body, path
        assert headers["Content-Type"].startswith("text/plain")


def test_head_answers_the_status_without_a_body_and_post_is_refused(
        served: str, node: FakeNode, clock: Clock) -> None:
    status, headers, body = get(f"{served}/readyz", "HEAD")
    assert (status, body) == (503, b"") and int(headers["Content-Length"]) > 0
    node.land(clock.now)
    assert get(f"{served}/readyz", "HEAD")[:1] == (200,)
    status, headers, _ = get(f"{served}/healthz", "POST")
    assert status == 405 and headers["Allow"] == "GET, HEAD"


def test_without_a_probe_the_port_says_serving() -> None:
    port = free_port()
    server: Any = metrics.serve(port, "127.0.0.1", CollectorRegistry())
    try:
        status, _, body = get(f"http://127.0.0.1:{port}/healthz")
        assert (status, json.loads(body)) == (200, {"ok": True, "reason": "serving"})
    finally:
        server.shutdown()
        server.server_close()


def test_port_zero_serves_nothing() -> None:
    assert metrics.serve(0) is None
