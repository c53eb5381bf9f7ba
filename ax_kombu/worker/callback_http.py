"""The transport under :mod:`ax_kombu.worker.callbacks`: pooled urllib3 connections, each
call bounded by one deadline.

Socket timeouts bound each read, not a call: a server that sends one byte a second never
trips them. So every call runs inside :func:`deadline_scope`; the sockets its connections
use are registered with a watchdog thread, which shuts them down (``SHUT_RDWR``) when the
deadline passes, whatever phase the call is in (connect, TLS handshake, send, headers,
body). Pools are keyed by (scheme, address, port, host name): the pool's host is the
address that was checked, so urllib3 never resolves a name; HTTPS pools verify the
certificate against the host name and send it as SNI.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

#: pools kept (one per scheme, address, port and host name); the least recently used goes
MAX_POOLS = 32
#: idle connections kept per pool
POOL_CONNECTIONS = 8


class Call:
    """One call's deadline and the sockets it uses (shut down when the deadline passes)."""

    __slots__ = ("_lock", "_sockets", "deadline", "expired", "finished")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.expired = False
        self.finished = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            late = self.expired
        if late:
            _shut(sock)

    def expire(self) -> None:
        with self._lock:
            if self.finished:
                return
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def finish(self) -> bool:
        """Mark the call over; True if its deadline had passed (its sockets are dead)."""
        with self._lock:
            self.finished = True
            return self.expired

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Watchdog:
    """One daemon thread that expires calls whose deadline has passed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active: set[Call] = set()
        self._thread: threading.Thread | None = None

    def watch(self, call: Call) -> None:
        with self._cond:
            self._active.add(call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ax-callback-deadlines",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def unwatch(self, call: Call) -> None:
        with self._cond:
            self._active.discard(call)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                expired = [c for c in self._active if c.deadline <= now]
                self._active.difference_update(expired)
                if not expired:
                    first = min((c.deadline for c in self._active), default=None)
                    self._cond.wait(None if first is None else first - now)
            for call in expired:
                call.expire()


_watchdog = _Watchdog()
_current = threading.local()


def _register(sock: socket.socket | None) -> None:
    call: Call | None = getattr(_current, "call", None)
    if call is not None and sock is not None:
        call.add(sock)


class _HTTPConnection(HTTPConnection):
    """A connection whose socket is watched by the calling thread's deadline."""

    def _new_conn(self) -> socket.socket:
        sock = super()._new_conn()
        _register(sock)
        return sock

    def request(self, *args: Any, **kwargs: Any) -> None:
        _register(self.sock)  # a reused connection
        super().request(*args, **kwargs)


class _HTTPSConnection(HTTPSConnection):
    def _new_conn(self) -> socket.socket:
        sock = super()._new_conn()
        _register(sock)
        return sock

    def request(self, *args: Any, **kwargs: Any) -> None:
        _register(self.sock)
        super().request(*args, **kwargs)


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


class Pools:
    """Connection pools by (scheme, address, port, host name); thread-safe, LRU-bounded."""

    def __init__(self, max_pools: int = MAX_POOLS) -> None:
        self._lock = threading.Lock()
        self._pools: OrderedDict[tuple[str, str, int, str], HTTPConnectionPool] = OrderedDict()
        self._max = max_pools

    def get(self, scheme: str, address: str, port: int, host: str) -> HTTPConnectionPool:
        """The pool that connects to ``address`` for ``host`` (made on first use)."""
        key = (scheme, address, port, host)
        with self._lock:
            pool = self._pools.get(key)
            if pool is not None:
                self._pools.move_to_end(key)
                return pool
            pool = self._new(scheme, address, port, host)
            self._pools[key] = pool
            if len(self._pools) > self._max:
                self._pools.popitem(last=False)[1].close()
            return pool

    @staticmethod
    def _new(scheme: str, address: str, port: int, host: str) -> HTTPConnectionPool:
        common: dict[str, Any] = {"maxsize": POOL_CONNECTIONS, "block": False, "retries": False}
        if scheme == "https":
            return _HTTPSPool(address, port, server_hostname=host, assert_hostname=host,
                              cert_reqs="CERT_REQUIRED", **common)
        return _HTTPPool(address, port, **common)

    def clear(self) -> None:
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            pool.close()


pools = Pools()


@contextmanager
def deadline_scope(deadline: float) -> Iterator[Call]:
    """Run the block as one call ending at ``deadline`` (``time.monotonic()``): sockets the
    block's connections use are shut down when it passes."""
    call = Call(deadline)
    _current.call = call
    _watchdog.watch(call)
    try:
        yield call
    finally:
        _current.call = None
        _watchdog.unwatch(call)
        call.finish()


def current_expired() -> bool:
    """True if the calling thread's call has reached its deadline."""
    call: Call | None = getattr(_current, "call", None)
    return call is not None and (call.expired or call.remaining() <= 0)
