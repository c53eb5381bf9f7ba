"""HTTP callbacks as an attacker would use them: internal addresses, drip servers,
redirects, huge answers; and the signature a receiver checks.

Every server here is a real one on 127.0.0.1, in a thread.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import shutil
import socket
import ssl
import subprocess
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import urllib3.util.connection
from standardwebhooks import Webhook, WebhookVerificationError

from ax_kombu.config import from_env
from ax_kombu.exceptions import CallbackFailed, ConfigurationError, ProcessorRefused
from ax_kombu.worker import callbacks
from ax_kombu.worker.callback_targets import address_refusal, host_allowed
from ax_kombu.worker.callbacks import post_callback
from ax_kombu.worker.processors import Context, Resolver

from ..loopback_http import serving

pytestmark = pytest.mark.timeout(30)

CTX = Context(task_id=7, attempt=1, trace_id="tr-cb", trigger_time=1000, task_type="t",
              retry_count=0, max_retry=3, timeout_ms=2000)
LOCAL = ("127.0.0.1",)
SECRET = "s3cret-for-tests"
WHSEC = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "callbacks.md"


def _documented_verify() -> Callable[..., bool]:
    """The receiver check exactly as the module docstring shows it."""
    doc = callbacks.__doc__ or ""
    block = textwrap.dedent(doc.split("A receiver checks it with::", 1)[1].split("\n\n(", 1)[0])
    namespace: dict[str, Any] = {"hmac": hmac, "hashlib": hashlib, "time": time}
    exec(block, namespace)  # noqa: S102 - our own documentation
    verify: Callable[..., bool] = namespace["verify"]
    return verify


class _Receiver(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[dict[str, Any]]] = []
    huge_sent: ClassVar[list[int]] = []

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append({"path": self.path, "raw": raw, "headers": dict(self.headers),
                          "peer": self.client_address})
        route = getattr(self, "_" + self.path.strip("/").split("?")[0], None)
        if route is not None:
            route(raw)
        else:
            self._answer(200, b"{}")

    def _answer(self, status: int, body: bytes, **headers: str) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, raw: bytes) -> None:
        self._answer(302, b"", Location="/ok")

    def _fail(self, raw: bytes) -> None:
        self._answer(500, b"INTERNAL-SECRET-DETAIL " * 10)

    def _signed(self, raw: bytes) -> None:
        """A receiver using the Standard Webhooks library (the default signing)."""
        try:
            Webhook(SECRET.encode()).verify(raw, dict(self.headers))
            ok = True
        except WebhookVerificationError:
            ok = False
        self._answer(200 if ok else 401, b"")

    def _signed_whsec(self, raw: bytes) -> None:
        try:
            Webhook(WHSEC).verify(raw, dict(self.headers))
            ok = True
        except WebhookVerificationError:
            ok = False
        self._answer(200 if ok else 401, b"")

    def _signed_legacy(self, raw: bytes) -> None:
        try:
            ok = _documented_verify()(SECRET.encode(), self.headers, raw)
        except (AttributeError, KeyError, TypeError, ValueError):  # a header is missing
            ok = False
        self._answer(200 if ok else 401, b"")

    def _huge(self, raw: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(100 * 1024 * 1024))
        self.end_headers()
        chunk, sent = b"x" * 65536, 0
        try:
            for _ in range(1600):
                self.wfile.write(chunk)
                sent += len(chunk)
        except OSError:
            pass
        self.huge_sent.append(sent)

    def _drip(self, raw: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "100")
        self.end_headers()
        self._drip_bytes(b"x" * 100)

    def _drip_head(self, raw: bytes) -> None:
        self._drip_bytes(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    def _drip_bytes(self, data: bytes) -> None:
        try:
            for i in range(len(data)):
                self.wfile.write(data[i:i + 1])
                self.wfile.flush()
                time.sleep(1.0)
        except OSError:
            pass
        self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Receiver.seen, _Receiver.huge_sent = [], []
    with serving(_Receiver) as url:
        yield url
    callbacks.pools.clear()


@pytest.fixture
def no_connect(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every TCP connect urllib3 tries, recorded and refused."""
    tried: list[Any] = []

    def refuse(address: Any, *args: Any, **kwargs: Any) -> socket.socket:
        tried.append(address)
        raise AssertionError(f"connected to {address}")

    monkeypatch.setattr(urllib3.util.connection, "create_connection", refuse)
    return tried


def _fake_dns(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[list[str]]]) -> list[str]:
    """Names in ``answers`` resolve to the next list of addresses on each lookup."""
    real = socket.getaddrinfo
    lookups: list[str] = []

    def getaddrinfo(host: str, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in answers:
            return real(host, port, *args, **kwargs)
        lookups.append(host)
        addresses = answers[host][min(lookups.count(host), len(answers[host])) - 1]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return lookups


# --- where a callback may go ----------------------------------------------------------------


@pytest.mark.parametrize(("address", "kind"), [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.0.0.1", "private"),
    ("192.168.1.10", "private"), ("172.16.0.1", "private"), ("169.254.169.254", "link-local"),
    ("fe80::1", "link-local"), ("224.0.0.1", "multicast"), ("0.0.0.0", "unspecified"),
    ("240.0.0.1", "reserved"), ("100.64.0.1", "not a globally routable"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:169.254.169.254", "link-local"),
    ("64:ff9b::a00:1", "private"), ("2002:7f00:1::1", "loopback"),
])
def test_internal_addresses_are_named_and_refused(address: str, kind: str) -> None:
    assert kind in (address_refusal(address) or "")


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111"])
def test_public_addresses_may_be_called(address: str) -> None:
    assert address_refusal(address) is None


@pytest.mark.parametrize("url", ["http://127.0.0.1:{port}/ok", "http://169.254.169.254/latest",
                                 "http://10.0.0.1/hook", "https://[::1]:{port}/ok",
                                 "http://0.0.0.0:{port}/ok"])
def test_internal_targets_are_refused_by_default_before_any_connect(
        url: str, server: str, no_connect: list[Any]) -> None:
    started = time.monotonic()
    with pytest.raises(ProcessorRefused, match="refused: it resolves to .* address"):
        post_callback(url.format(port=server.rsplit(":", 1)[1]), {}, CTX, 5.0)
    assert time.monotonic() - started < 0.5
    assert no_connect == [] and _Receiver.seen == []


def test_a_listed_internal_host_is_called(server: str) -> None:
    assert post_callback(f"{server}/ok", {"a": 1}, CTX, 2.0, allow_hosts=LOCAL) == 200
    assert json.loads(_Receiver.seen[0]["raw"])["payload"] == {"a": 1}


def test_an_occurrence_of_a_recurring_job_says_which_in_the_body(server: str) -> None:
    occurrence = CTX._replace(job="report.daily", scheduled_at=1_796_000_000_000)
    assert post_callback(f"{server}/ok", {"a": 1}, occurrence, 2.0, allow_hosts=LOCAL) == 200
    assert post_callback(f"{server}/ok", {"a": 1}, CTX, 2.0, allow_hosts=LOCAL) == 200
    first, second = (json.loads(seen["raw"]) for seen in _Receiver.seen)
    assert (first["job"], first["scheduled_at"]) == ("report.daily", 1_796_000_000_000)
    assert "job" not in second and "scheduled_at" not in second


def test_a_name_resolving_to_loopback_is_refused_unless_listed(server: str) -> None:
    url = server.replace("127.0.0.1", "localhost") + "/ok"
    with pytest.raises(ProcessorRefused, match="'localhost' refused: it resolves to"):
        post_callback(url, {}, CTX, 2.0)
    assert _Receiver.seen == []
    assert post_callback(url, {}, CTX, 2.0, allow_hosts=["localhost"]) == 200
    assert _Receiver.seen[0]["headers"]["Host"] == url.split("/")[2]


def test_every_address_of_a_name_is_checked(monkeypatch: pytest.MonkeyPatch,
                                            no_connect: list[Any]) -> None:
    _fake_dns(monkeypatch, {"mixed.test": [["93.184.216.34", "10.1.2.3"]]})
    with pytest.raises(ProcessorRefused, match="10.1.2.3, a private address"):
        post_callback("http://mixed.test/hook", {}, CTX, 2.0)
    assert no_connect == []


def test_the_address_checked_is_the_address_connected(server: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS rebinding: a second lookup would answer elsewhere; there is no second lookup."""
    port = server.rsplit(":", 1)[1]
    lookups = _fake_dns(monkeypatch, {"rebind.test": [["127.0.0.1"], ["10.9.9.9"]]})
    url = f"http://rebind.test:{port}/ok"
    assert post_callback(url, {}, CTX, 2.0, allow_hosts=["*.test"]) == 200
    assert lookups == ["rebind.test"]
    assert _Receiver.seen[0]["headers"]["Host"] == f"rebind.test:{port}"


def test_a_host_not_on_a_non_empty_list_is_refused(server: str) -> None:
    with pytest.raises(ProcessorRefused, match="not in AX_CALLBACK_ALLOW_HOSTS"):
        post_callback(f"{server}/ok", {}, CTX, 2.0, allow_hosts=["hooks.example.com"])
    assert host_allowed("db.internal", ["*.internal"])
    assert not host_allowed("internal", ["*.internal"])


@pytest.mark.parametrize("url", ["ftp://example.com/x", "file:///etc/passwd", "gopher://h/",
                                 "http:///nohost", "http://example.com:99999/"])
def test_only_http_and_https_urls_with_a_host_are_called(url: str) -> None:
    with pytest.raises(ProcessorRefused, match="not an http"):
        post_callback(url, {}, CTX, 2.0)


# --- one deadline per call ------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/drip", "/drip_head"])
def test_a_dripping_server_is_cut_off_at_the_deadline(server: str, path: str) -> None:
    started = time.monotonic()
    with pytest.raises(CallbackFailed, match="did not answer within 1.5s"):
        post_callback(server + path, {}, CTX, 1.5, allow_hosts=LOCAL)
    assert time.monotonic() - started < 1.5 + 1.0


def test_the_resolved_callback_stops_at_the_runs_deadline(server: str) -> None:
    call = Resolver(allow_hosts=LOCAL).resolve(None, f"{server}/drip")
    started = time.monotonic()
    ctx = CTX._replace(timeout_ms=60_000, deadline=started + 1.0)
    with pytest.raises(CallbackFailed, match="did not answer"):
        call({}, ctx)
    assert time.monotonic() - started < 1.0 + 1.0


def test_a_redirect_is_a_failure_and_is_not_followed(server: str) -> None:
    with pytest.raises(CallbackFailed, match="answered HTTP 302"):
        post_callback(f"{server}/redirect", {}, CTX, 2.0, allow_hosts=LOCAL)
    assert [s["path"] for s in _Receiver.seen] == ["/redirect"]


def test_a_huge_answer_is_not_read_past_the_cap(server: str) -> None:
    started = time.monotonic()
    assert post_callback(f"{server}/huge", {}, CTX, 5.0, allow_hosts=LOCAL) == 200
    assert time.monotonic() - started < 2.0
    while not _Receiver.huge_sent and time.monotonic() - started < 10:
        time.sleep(0.05)
    assert _Receiver.huge_sent[0] < 50 * 1024 * 1024  # the client hung up long before 100 MiB
    assert post_callback(f"{server}/ok", {}, CTX, 2.0, allow_hosts=LOCAL) == 200


def test_a_failure_names_the_status_not_the_answer(server: str) -> None:
    with pytest.raises(CallbackFailed) as caught:
        post_callback(f"{server}/fail", {}, CTX, 2.0, allow_hosts=LOCAL)
    assert str(caught.value) == "callback answered HTTP 500"


def test_urls_in_errors_are_redacted() -> None:
    with pytest.raises(CallbackFailed) as caught:
        post_callback("http://user:pw@127.0.0.1:9/x?token=T0KEN", {}, CTX, 2.0,
                      allow_hosts=LOCAL)
    text = str(caught.value)
    assert "cannot connect" in text and "T0KEN" not in text and ":pw@" not in text
    with pytest.raises(ProcessorRefused) as refused:
        post_callback("ftp://u:pw@h/x?token=T0KEN", {}, CTX, 2.0)
    assert "T0KEN" not in str(refused.value) and ":pw@" not in str(refused.value)


def test_connections_are_pooled_and_shared_by_threads(server: str) -> None:
    results: list[int] = []

    def one() -> None:
        results.append(post_callback(f"{server}/ok", {}, CTX, 5.0, allow_hosts=LOCAL))

    threads = [threading.Thread(target=one) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 20
    before = len({s["peer"] for s in _Receiver.seen})
    for _ in range(5):
        post_callback(f"{server}/ok", {}, CTX, 5.0, allow_hosts=LOCAL)
    assert len({s["peer"] for s in _Receiver.seen}) == before  # no new connection


# --- signing --------------------------------------------------------------------------------


def test_a_signed_request_passes_the_standard_webhooks_check(server: str) -> None:
    assert post_callback(f"{server}/signed", {"coupon": "X"}, CTX, 2.0, allow_hosts=LOCAL,
                         secret=SECRET) == 200
    headers = _Receiver.seen[0]["headers"]
    assert headers["webhook-id"] == "msg_ax_7_1"  # the task and attempt: stable per attempt
    assert re.fullmatch(r"v1,[A-Za-z0-9+/]{43}=", headers["webhook-signature"])
    assert abs(int(headers["webhook-timestamp"]) - time.time()) < 5
    assert "X-Ax-Signature" not in headers and "X-Ax-Timestamp" not in headers
    with pytest.raises(CallbackFailed, match="HTTP 401"):
        post_callback(f"{server}/signed", {}, CTX, 2.0, allow_hosts=LOCAL, secret="wrong")
    with pytest.raises(CallbackFailed, match="HTTP 401"):
        post_callback(f"{server}/signed", {}, CTX, 2.0, allow_hosts=LOCAL)


def test_a_whsec_secret_is_the_standard_base64_key(server: str) -> None:
    assert post_callback(f"{server}/signed_whsec", {"n": 1}, CTX, 2.0, allow_hosts=LOCAL,
                         secret=WHSEC) == 200
    with pytest.raises(CallbackFailed, match="HTTP 401"):  # not its text's bytes
        post_callback(f"{server}/signed", {"n": 1}, CTX, 2.0, allow_hosts=LOCAL, secret=WHSEC)


def test_legacy_signing_passes_the_documented_receiver_check(server: str) -> None:
    assert post_callback(f"{server}/signed_legacy", {"coupon": "X"}, CTX, 2.0,
                         allow_hosts=LOCAL, secret=SECRET, signing_scheme="legacy") == 200
    headers = _Receiver.seen[0]["headers"]
    assert re.fullmatch(r"sha256=[0-9a-f]{64}", headers["X-Ax-Signature"])
    assert abs(int(headers["X-Ax-Timestamp"]) - time.time()) < 5
    assert "webhook-signature" not in headers
    with pytest.raises(CallbackFailed, match="HTTP 401"):
        post_callback(f"{server}/signed_legacy", {}, CTX, 2.0, allow_hosts=LOCAL,
                      secret="wrong", signing_scheme="legacy")
    with pytest.raises(CallbackFailed, match="HTTP 401"):  # the default is not legacy
        post_callback(f"{server}/signed_legacy", {}, CTX, 2.0, allow_hosts=LOCAL,
                      secret=SECRET)


def test_the_check_in_the_docs_is_the_one_in_the_module() -> None:
    doc = callbacks.__doc__ or ""
    block = textwrap.dedent(doc.split("A receiver checks it with::", 1)[1].split("\n\n(", 1)[0])
    assert block.strip() in DOCS.read_text()


def test_the_secret_reaches_the_resolver_and_is_never_shown(server: str) -> None:
    settings = from_env({"AX_CALLBACK_SECRET": SECRET, "AX_CALLBACK_ALLOW_HOSTS": "127.0.0.1"})
    assert SECRET not in repr(settings)
    assert settings.callback_signing == "standard"
    resolver = Resolver(allow_hosts=["127.0.0.1"], callback_secret=settings.callback_secret)
    assert SECRET not in repr(resolver)
    assert resolver.resolve(None, f"{server}/signed")({}, CTX) == 200


def test_the_legacy_setting_reaches_the_resolver(server: str) -> None:
    settings = from_env({"AX_CALLBACK_SECRET": SECRET, "AX_CALLBACK_SIGNING": "legacy"})
    resolver = Resolver(allow_hosts=["127.0.0.1"], callback_secret=settings.callback_secret,
                        callback_signing=settings.callback_signing)
    assert resolver.resolve(None, f"{server}/signed_legacy")({}, CTX) == 200
    with pytest.raises(ConfigurationError, match="callback_signing must be one of"):
        from_env({"AX_CALLBACK_SIGNING": "hmac"})


# --- TLS to the checked address -------------------------------------------------------------


@pytest.fixture
def tls_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, list[str]]]:
    """An HTTPS server on 127.0.0.1 whose certificate names only ``localhost``, trusted by
    the test (SSL_CERT_FILE); yields its port and the SNI names it was sent."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    names: list[str] = []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda sock, name, ctx: names.append(str(name)) and None
    _Receiver.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    httpd.daemon_threads = True
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1], names
    httpd.shutdown()
    httpd.server_close()
    callbacks.pools.clear()


def test_tls_verifies_the_url_host_name_while_connecting_to_the_checked_address(
        tls_server: tuple[int, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    port, names = tls_server
    lookups = _fake_dns(monkeypatch, {"localhost": [["127.0.0.1"]]})
    assert post_callback(f"https://localhost:{port}/ok", {}, CTX, 5.0,
                         allow_hosts=["localhost"]) == 200
    assert lookups == ["localhost"] and names == ["localhost"]
    assert _Receiver.seen[0]["headers"]["Host"] == f"localhost:{port}"
    with pytest.raises(CallbackFailed, match="TLS error"):  # the certificate names localhost
        post_callback(f"https://127.0.0.1:{port}/ok", {}, CTX, 5.0, allow_hosts=LOCAL)
