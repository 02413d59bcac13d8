"""The Stripe emulator's HTTP side (:mod:`payorch.providers.stripe.emulator`): a stdlib
``ThreadingHTTPServer`` on loopback handing each request to the API's state, and the replies
in Stripe's shapes. Apart from the state so each stays small enough to read whole."""

from __future__ import annotations

import json
import secrets
import socket
import socketserver
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol, cast

__all__ = ["API_ERROR", "Handles", "Reply", "Server", "new_id", "reply_error"]

API_ERROR = (500, "api_error", "Something went wrong on Stripe's end.")


def new_id(prefix: str) -> str:
    """A fresh Stripe-looking id: ``pi_…``, ``re_…``, ``ch_…``."""
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class Reply:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    save: bool = True  # kept under the Idempotency-Key (False: refused before executing)
    drop: bool = False  # close the connection without answering


def reply_error(
    status: int, etype: str, message: str, *, save: bool = True, **fields: Any
) -> Reply:
    """An answer in Stripe's error shape: ``{"error": {"type", "message", …}}``."""
    return Reply(status, {"error": {"type": etype, "message": message, **fields}}, save=save)


class Handles(Protocol):
    def handle(
        self, method: str, target: str, headers: Mapping[str, str], body: bytes
    ) -> Reply: ...


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, stripe: Handles) -> None:
        self.stripe = stripe
        super().__init__(("127.0.0.1", 0), _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's name, which loopback does not need.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "127.0.0.1", int(self.server_address[1])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30  # an idle keep-alive connection holds its (daemon) thread no longer

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in two writes: without this, Nagle and a delayed ACK
        # stall each answer by ~40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the tests assert on the ledger, not on a log

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            reply = cast(Server, self.server).stripe.handle(self.command, self.path, headers, body)
        except Exception:  # noqa: BLE001 - a request it cannot read: answer as Stripe would
            reply = reply_error(*API_ERROR)
        if reply.drop:
            self.close_connection = True  # the effect is made; the client hears nothing
            return
        data = json.dumps(reply.body).encode()
        try:
            self.send_response(reply.status)
            sent = {"Content-Type": "application/json", "Content-Length": str(len(data))}
            for name, value in (sent | {"Request-Id": new_id("req")} | reply.headers).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True

    do_GET = do_POST
