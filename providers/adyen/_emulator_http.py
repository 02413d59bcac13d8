"""The Adyen emulator's HTTP side (:mod:`payorch.providers.adyen.emulator`): a stdlib
``ThreadingHTTPServer`` on loopback handing each request to the emulator, and its replies."""

from __future__ import annotations

import json
import socketserver
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol, cast

__all__ = ["Handles", "Reply", "Server", "error"]

_MAX_BODY = 1 << 20


@dataclass
class Reply:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    drop: bool = False  # close the connection unanswered


def error(status: int, code: str, message: str, kind: str = "validation", **headers: str) -> Reply:
    """An answer in Checkout's error shape; ``Retry_After="1"`` is the header Retry-After."""
    body = {"status": status, "errorCode": code, "message": message, "errorType": kind}
    return Reply(
        status=status, body=body, headers={k.replace("_", "-"): v for k, v in headers.items()}
    )


class Handles(Protocol):
    def handle(self, method: str, path: str, headers: Mapping[str, str], raw: bytes) -> Reply: ...


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], emulator: Handles) -> None:
        self.emulator = emulator
        super().__init__(address, _Handler)

    def server_bind(self) -> None:  # no reverse DNS look-up of loopback (HTTPServer's)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "127.0.0.1", int(self.server_address[1])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "adyen-emulator/1"
    sys_version = ""
    timeout = 30

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _dispatch(self) -> None:
        emulator = cast(Server, self.server).emulator
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 <= length <= _MAX_BODY:
            self.close_connection = True
            return
        raw = self.rfile.read(length)
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            reply = emulator.handle(self.command, self.path, headers, raw)
        except Exception:  # noqa: BLE001 - answer 500 like a real API and keep serving
            reply = error(500, "000", "Internal error", "internal")
        if reply.drop:
            self.close_connection = True  # the effect is made; the answer never comes
            return
        content = json.dumps(reply.body).encode()
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(content)))
            self.send_header("pspReference", str(reply.body.get("pspReference", "")))
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(content)
        except OSError:
            self.close_connection = True

    do_GET = do_POST = _dispatch
