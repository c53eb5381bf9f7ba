"""Processor resolution (registry, allow-listed dotted paths) and HTTP callbacks."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import time
import warnings
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar

import pytest

from ax_kombu.exceptions import (
    CallbackFailed,
    ConfigurationError,
    ProcessorNotFound,
    ProcessorRefused,
    ValidationError,
)
from ax_kombu.worker.processors import (
    Context,
    Resolver,
    call,
    call_async,
    check_callback_url,
    host_allowed,
    is_async,
    load_modules,
    post_callback,
    processor,
    registered,
)

from .. import procs_worker
from ..loopback_http import serving

pytestmark = pytest.mark.timeout(30)

CTX = Context(task_id=42, attempt=3, trace_id="tr-abc", trigger_time=1000, task_type="t",
              retry_count=1, max_retry=3, timeout_ms=2000)
#: the test servers listen on loopback, which callbacks may call only when it is listed
LOCAL = ["127.0.0.1"]


def test_registry_maps_a_name_to_the_decorated_function() -> None:
    @processor("unit.hello")
    def hello(payload: Any, ctx: Context) -> str:
        return f"hello {payload} from {ctx.task_id}"

    assert registered("unit.hello") is hello
    assert Resolver().resolve("unit.hello")("you", CTX) == "hello you from 42"


def test_an_unknown_name_is_a_clear_error() -> None:
    with pytest.raises(ProcessorNotFound, match="no processor 'unit.nope'.*-A"):
        Resolver().resolve("unit.nope")
    with pytest.raises(ProcessorNotFound):
        Resolver().resolve(None)


@pytest.mark.parametrize("name", ["os:system", "subprocess:run", "builtins:eval",
                                  "ax_kombu_canary_never_imported:run"])
def test_dotted_paths_outside_the_loaded_modules_are_refused_without_importing(
        name: str) -> None:
    resolver = Resolver(modules=["tests.procs_worker"])
    with pytest.raises(ProcessorRefused, match="not a module this worker was told to load"):
        resolver.resolve(name)
    assert "ax_kombu_canary_never_imported" not in sys.modules


def test_a_dotted_path_inside_a_loaded_module_resolves() -> None:
    func = Resolver(modules=["tests.procs_worker"]).resolve("tests.procs_worker:double")
    assert func({"n": 21}, CTX) == 42


@pytest.mark.parametrize("name,error", [
    ("tests.procs_worker:run", ProcessorRefused),      # imported from subprocess, not defined
    ("tests.procs_worker:_private", ProcessorRefused),
    ("tests.procs_worker:os.system", ProcessorRefused),
    ("tests.procs_worker:release", ProcessorRefused),  # not callable
    ("tests.procs_worker:missing", ProcessorNotFound),
])
def test_only_public_functions_defined_in_the_module_are_reachable(
        name: str, error: type[Exception]) -> None:
    assert callable(procs_worker.__dict__["run"])  # it is there, and still refused
    with pytest.raises(error):
        Resolver(modules=["tests.procs_worker"]).resolve(name)


def test_load_modules_reports_a_bad_module_in_one_line() -> None:
    assert load_modules(["tests.procs_worker"]) == ["tests.procs_worker"]
    with pytest.raises(ConfigurationError, match="cannot import processor module 'no.such.mod'"):
        load_modules(["no.such.mod"])


def test_callback_hosts_allow_list() -> None:
    assert host_allowed("api.example.com", ["*.example.com"])
    assert not host_allowed("example.com.evil.org", ["*.example.com"])
    assert host_allowed("Hooks.Local", ["hooks.local"])
    check_callback_url("http://127.0.0.1:9/x")  # no list: any host
    with pytest.raises(ProcessorRefused, match="'evil.org' refused"):
        check_callback_url("https://evil.org/x", ["*.example.com"])
    with pytest.raises(ProcessorRefused, match="not an http"):
        check_callback_url("file:///etc/passwd")
    with pytest.raises(ProcessorRefused):
        Resolver(allow_hosts=["hooks.local"]).resolve(None, "http://127.0.0.1/x")


class _Handler(BaseHTTPRequestHandler):
    seen: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append({"path": self.path, "body": body,
                          "trace": self.headers.get("X-Trace-Id"),
                          "type": self.headers.get("Content-Type")})
        if self.path == "/slow":
            time.sleep(1.0)
        status = {"/ok": 200, "/created": 201, "/fail": 500, "/redirect": 302}.get(self.path, 200)
        self.send_response(status)
        if status == 302:
            self.send_header("Location", "http://127.0.0.1:9/elsewhere")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Handler.seen = []
    with serving(_Handler) as url:
        yield url


def test_a_2xx_answer_is_success_and_the_post_carries_task_and_trace(server: str) -> None:
    assert post_callback(f"{server}/ok", {"coupon": "X"}, CTX, 2.0, allow_hosts=LOCAL) == 200
    assert post_callback(f"{server}/created", [1, 2], CTX, 2.0, allow_hosts=LOCAL) == 201
    first = _Handler.seen[0]
    assert first["body"] == {"payload": {"coupon": "X"}, "task_id": 42, "attempt": 3,
                             "trace_id": "tr-abc"}
    assert first["trace"] == "tr-abc" and first["type"] == "application/json"


def test_a_500_answer_is_a_failure(server: str) -> None:
    with pytest.raises(CallbackFailed, match="HTTP 500"):
        post_callback(f"{server}/fail", None, CTX, 2.0, allow_hosts=LOCAL)


def test_a_redirect_is_a_failure_and_is_not_followed(server: str) -> None:
    with pytest.raises(CallbackFailed, match="HTTP 302"):
        post_callback(f"{server}/redirect", None, CTX, 2.0, allow_hosts=LOCAL)
    assert [s["path"] for s in _Handler.seen] == ["/redirect"]


def test_no_answer_in_time_is_a_failure(server: str) -> None:
    started = time.monotonic()
    with pytest.raises(CallbackFailed, match="did not answer within 0.2s"):
        post_callback(f"{server}/slow", None, CTX, 0.2, allow_hosts=LOCAL)
    assert time.monotonic() - started < 0.9


def test_an_unreachable_callback_is_a_failure() -> None:
    with pytest.raises(CallbackFailed, match="callback failed"):
        post_callback("http://127.0.0.1:9/nothing-listens", None, CTX, 2.0,
                      allow_hosts=LOCAL)


def test_the_resolved_callback_uses_the_task_timeout(server: str) -> None:
    call = Resolver(allow_hosts=LOCAL).resolve(None, f"{server}/slow")
    quick = CTX._replace(timeout_ms=200)
    with pytest.raises(CallbackFailed, match="within 0.2s"):
        call({}, quick)


async def _async_body(payload: Any, ctx: Context) -> None:
    ran.append(payload)

ran: list[Any] = []


class _AsyncCall:
    async def __call__(self, payload: Any, ctx: Context) -> None:
        ran.append(payload)


@pytest.mark.parametrize("func", [_async_body, functools.partial(_async_body), _AsyncCall()],
                         ids=["async-def", "partial", "async-call"])
def test_an_async_processor_is_registered_and_awaited_by_call_async(func: Any) -> None:
    ran.clear()
    assert processor("unit.async")(func) is func
    assert registered("unit.async") is func and is_async(func)
    asyncio.run(call_async(func, {"i": 2}, CTX))
    assert ran == [{"i": 2}]


async def _async_gen(payload: Any, ctx: Context) -> Any:
    yield payload


def test_registering_an_async_generator_is_refused_and_registers_nothing() -> None:
    with pytest.raises(ValidationError, match="async generator"):
        processor("unit.asyncgen")(_async_gen)
    assert registered("unit.asyncgen") is None


def test_an_empty_task_type_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match="non-empty task type"):
        processor("")


def test_a_processor_returning_an_awaitable_fails_and_its_body_never_runs() -> None:
    ran.clear()

    def sneaky(payload: Any, ctx: Context) -> Any:
        return _async_body(payload, ctx)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine was never awaited" would be one
        with pytest.raises(ProcessorRefused, match="returned coroutine.*declare it async def"):
            call(sneaky, {"i": 1}, CTX)
    assert ran == []
    assert call(lambda p, c: p * 2, 21, CTX) == 42
