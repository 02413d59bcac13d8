"""A merchant's webhook endpoint on loopback: it verifies Standard Webhooks signatures and
applies each ``webhook-id`` once, counting what it was sent and what it applied."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


class Receiver:
    def __init__(self, secret: str = SECRET, status: int = 200) -> None:
        self.verifier = Webhook(secret)
        self.status = status  # what it answers a valid delivery
        self.lock = threading.Lock()
        self.received: list[str] = []  # every valid delivery's webhook-id, duplicates too
        self.applied: dict[str, dict[str, Any]] = {}  # webhook-id -> the body, applied once
        self.refused = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/hooks"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    receiver.verifier.verify(body, headers)
                except WebhookVerificationError:
                    with receiver.lock:
                        receiver.refused += 1
                    self._reply(400)
                    return
                message_id = headers["webhook-id"]
                with receiver.lock:
                    receiver.received.append(message_id)
                    receiver.applied.setdefault(message_id, json.loads(body))
                self._reply(receiver.status)

            def _reply(self, status: int) -> None:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler


@contextmanager
def receiving(status: int = 200) -> Iterator[Receiver]:
    receiver = Receiver(status=status)
    receiver.thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()
