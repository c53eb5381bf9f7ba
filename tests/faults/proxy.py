"""A TCP proxy that can cut the database off: 127.0.0.1:random → PostgreSQL.

:meth:`TcpProxy.cut` closes every proxied connection and refuses new ones for N seconds
(a failover, a restart). A cluster's daemons may reach the store through it while the
test's own reads and the producer go direct.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class TcpProxy:
    """127.0.0.1:``port`` → ``target``, one thread per direction of each connection.

    :meth:`cut` closes every proxied connection and refuses new ones (accepted and reset
    at once) for N seconds; then connections pass again.
    """

    def __init__(self, target: tuple[str, int] = ("127.0.0.1", 5432)) -> None:
        self.target = target
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(256)
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._refuse_until = 0.0
        self._closed = False
        self.refused = 0
        self.cut_connections = 0
        self._thread = threading.Thread(target=self._accept_loop, name="db-proxy", daemon=True)
        self._thread.start()

    def url(self, database_url: str) -> str:
        """``database_url`` with its host and port replaced by this proxy's."""
        from urllib.parse import urlsplit

        parts = urlsplit(database_url)
        user = parts.netloc.rpartition("@")[0]
        netloc = (user + "@" if user else "") + f"127.0.0.1:{self.port}"
        return parts._replace(netloc=netloc).geturl()

    @property
    def refusing(self) -> bool:
        return time.monotonic() < self._refuse_until

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refusing:
                self.refused += 1
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._sockets |= {client, upstream}
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._sockets.discard(src)
                self._sockets.discard(dst)

    def cut(self, seconds: float) -> None:
        """Close every proxied connection now and refuse new ones for ``seconds``."""
        self._refuse_until = time.monotonic() + seconds
        with self._lock:
            sockets = list(self._sockets)
            self._sockets.clear()
        self.cut_connections += len(sockets) // 2
        for s in sockets:
            _reset(s)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut(0)
        self._thread.join(5)


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (SO_LINGER 0), ignoring errors."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()

