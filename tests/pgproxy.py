"""A loopback TCP proxy in front of PostgreSQL, for tests that watch or break the wire.

Subclasses see each connection's bytes (``on_client``; ``on_server``, which may cut the
connection instead of forwarding) and may refuse new connections (``refusing``).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from typing import Any

import sqlalchemy as sa

__all__ = ["LoopbackProxy", "close_sockets"]


def close_sockets(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):  # already shut down by the peer
            s.shutdown(socket.SHUT_RDWR)
        s.close()


def _send(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the other side is gone; its recv ends the pump
        sock.sendall(data)


class LoopbackProxy:
    """Forwards 127.0.0.1 connections to PostgreSQL at ``host:port``."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self.connections = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    # -- what subclasses change ---------------------------------------------------------

    def refusing(self) -> bool:
        """Whether a new connection is closed at once (as by a dead server)."""
        return False

    def on_client(self, flow: dict[str, Any], data: bytes) -> None:
        """Bytes from the client, before they are forwarded; ``flow``: this connection's."""

    def on_server(self, flow: dict[str, Any], data: bytes) -> bool:
        """Bytes from the server: True forwards them, False cuts the connection instead."""
        return True

    # -- the proxy ----------------------------------------------------------------------

    def url(self, db_url: str) -> str:
        parsed = sa.make_url(db_url).set(host="127.0.0.1", port=self.port)
        return parsed.render_as_string(hide_password=False)

    def cut_all(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            close_sockets(*pair)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()
        self.cut_all()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            if self.refusing():
                close_sockets(client)
                continue
            server = socket.create_connection(self._target, timeout=5)
            with self._lock:
                self.connections += 1
                self._pairs.append((client, server))
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        flow: dict[str, Any] = {}
        with selectors.DefaultSelector() as sel:
            sel.register(client, selectors.EVENT_READ)
            sel.register(server, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.2):
                    sock = key.fileobj
                    try:
                        data = sock.recv(65536)  # type: ignore[union-attr]
                    except OSError:
                        data = b""
                    if not data:
                        close_sockets(client, server)
                        return
                    if sock is client:
                        self.on_client(flow, data)
                        _send(server, data)
                    elif self.on_server(flow, data):
                        _send(client, data)
                    else:
                        close_sockets(client, server)
                        return
