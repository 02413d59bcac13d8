"""What the outbox's sink tests share: a message as a relay hands it over, and a merchant's
webhook endpoint on loopback: it verifies Standard Webhooks signatures with
the official library and applies each ``webhook-id`` once, counting what it was sent and
what it applied. ``status`` is what it answers a verified delivery (a non-2xx applies
nothing); while ``hold`` is clear, it keeps each request waiting."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from payorch.outbox import OutboxMessage

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


CREATED = datetime(2025, 3, 1, 12, 30, 45, 123456, tzinfo=UTC)


def message(**changes: Any) -> OutboxMessage:
    """A message as a relay hands it to a sink (``changes`` override its fields)."""
    fields: dict[str, Any] = {
        "tenant_id": "t1",
        "id": str(uuid.uuid4()),
        "type": "payment.succeeded",
        "aggregate_type": "payment",
        "aggregate_id": "op-1",
        "payload": {"amount": 4200, "currency": "EUR", "note": "café"},
        "destination": "broker",
        "attempt": 1,
        "operation_id": "op-1",
        "created_at": CREATED,
    }
    fields.update(changes)
    return OutboxMessage(**fields)


class Receiver:
    def __init__(self, secret: str = SECRET, status: int = 200) -> None:
        self.verifier = Webhook(secret)
        self.status = status
        self.hold = threading.Event()
        self.hold.set()
        self.lock = threading.Lock()
        self.requests = 0  # every request, refused ones too
        self.refused = 0  # bad signatures
        self.timestamps: list[str] = []  # every request's webhook-timestamp, refused too
        self.received: list[str] = []  # every verified delivery's webhook-id, duplicates too
        self.applied: dict[str, Any] = {}  # webhook-id -> its data, applied once
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}/hooks"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver.lock:
                    receiver.requests += 1
                receiver.hold.wait(timeout=30)
                headers = {k.lower(): v for k, v in self.headers.items()}
                with receiver.lock:
                    receiver.timestamps.append(headers.get("webhook-timestamp", ""))
                try:
                    receiver.verifier.verify(body, headers)
                except WebhookVerificationError:
                    with receiver.lock:
                        receiver.refused += 1
                    self._reply(400)
                    return
                if receiver.status < 300:
                    message_id = headers["webhook-id"]
                    with receiver.lock:  # the dedupe: one effect per webhook-id
                        receiver.received.append(message_id)
                        receiver.applied.setdefault(message_id, json.loads(body)["data"])
                self._reply(receiver.status)

            def _reply(self, status: int) -> None:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler


@contextmanager
def receiving(secret: str = SECRET, status: int = 200) -> Iterator[Receiver]:
    receiver = Receiver(secret, status=status)
    receiver.thread.start()
    try:
        yield receiver
    finally:
        receiver.hold.set()
        receiver.server.shutdown()
        receiver.server.server_close()
