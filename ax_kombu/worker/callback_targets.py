"""Where a callback may go: a callback URL parsed and checked, its host resolved once.

A callback_url comes from whoever could enqueue a task (or write to the broker), so it is
treated as hostile (:mod:`ax_kombu.worker.callbacks` lists the rules): http and https only,
no internal address unless its host is allow-listed (``AX_CALLBACK_ALLOW_HOSTS``), and the
connection goes to the very address that was checked.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import NamedTuple
from urllib.parse import urlsplit

from ax_kombu.config import redact_url
from ax_kombu.exceptions import CallbackFailed, ProcessorRefused

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


class Target(NamedTuple):
    """A parsed callback URL."""

    scheme: str
    host: str
    port: int
    #: path and query, as sent in the request line
    path: str
    #: ``user:password`` from the URL, sent as basic auth
    userinfo: str | None


# --- what may be called ---------------------------------------------------------------------


def host_allowed(host: str, allow_hosts: Iterable[str]) -> bool:
    """True if ``host`` matches an entry: exactly, or ``*.domain`` for its subdomains."""
    host = host.lower().rstrip(".")
    for entry in allow_hosts:
        entry = entry.lower()
        if entry.startswith("*.") and host.endswith(entry[1:]):
            return True
        if host == entry:
            return True
    return False


def parse_target(url: str) -> Target:
    """``url`` split into what the call needs.

    Raises:
        ProcessorRefused: not an http(s) URL with a host and a valid port.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        port, parts = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ProcessorRefused(f"callback_url {redact_url(url)!r} refused: not an http(s) URL")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    userinfo = parts.netloc.rpartition("@")[0] or None
    default = 443 if parts.scheme == "https" else 80
    return Target(parts.scheme, parts.hostname.rstrip(".").lower(), port or default, path,
                  userinfo)


def check_callback_url(url: str, allow_hosts: Iterable[str] = ()) -> None:
    """Raise :class:`ProcessorRefused` unless ``url`` is http(s) to an allowed host.

    This is the check that needs no network: with an empty ``allow_hosts`` any host name
    passes here, and its addresses are checked when the call is made.
    """
    target = parse_target(url)
    hosts = tuple(allow_hosts)
    if hosts and not host_allowed(target.host, hosts):
        raise ProcessorRefused(f"callback_url host {target.host!r} refused: not in "
                               "AX_CALLBACK_ALLOW_HOSTS")


def _unwrap(address: Address) -> Address:
    """The IPv4 address an IPv6 address carries (mapped, 6to4, NAT64), else itself."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.sixtofour is not None:
            return address.sixtofour
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


def address_refusal(address: str) -> str | None:
    """Why ``address`` may not be called without being allow-listed (None: it may)."""
    ip = _unwrap(ipaddress.ip_address(address.split("%", 1)[0]))
    for kind in ("loopback", "link_local", "multicast", "unspecified", "reserved", "private"):
        if getattr(ip, f"is_{kind}"):
            return f"a {kind.replace('_', '-')} address"
    if not ip.is_global:
        return "not a globally routable address"
    return None


_dns_lock = threading.Lock()
_dns: ThreadPoolExecutor | None = None


def _lookup(host: str, port: int, timeout_s: float) -> list[str]:
    """The addresses ``host`` resolves to, in the resolver's order, within ``timeout_s``."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    global _dns
    with _dns_lock:
        if _dns is None:
            _dns = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ax-callback-dns")
        pool = _dns
    future = pool.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        infos = future.result(timeout=max(timeout_s, 0.0))
    except FutureTimeout:
        raise CallbackFailed(f"callback host {host!r} did not resolve within "
                             f"{timeout_s:.3g}s") from None
    except OSError as exc:
        raise CallbackFailed(f"callback host {host!r} does not resolve: {exc}") from None
    found: list[str] = []
    for info in infos:
        address = str(info[4][0]).split("%", 1)[0]
        if address not in found:
            found.append(address)
    return found


def resolve_checked(target: Target, allowed: bool, timeout_s: float) -> list[str]:
    """The addresses to connect to for ``target``, every one of them checked.

    Args:
        allowed: the host is on AX_CALLBACK_ALLOW_HOSTS (its addresses are not checked).

    Raises:
        ProcessorRefused: an address is internal and the host is not allow-listed.
        CallbackFailed: the host does not resolve in time.
    """
    addresses = _lookup(target.host, target.port, timeout_s)
    if not addresses:
        raise CallbackFailed(f"callback host {target.host!r} resolves to no address")
    if not allowed:
        for address in addresses:
            why = address_refusal(address)
            if why is not None:
                raise ProcessorRefused(
                    f"callback_url host {target.host!r} refused: it resolves to {address}, {why} "
                    "(list the host in AX_CALLBACK_ALLOW_HOSTS to allow it)")
    return addresses


# --- what an answer means -------------------------------------------------------------------
