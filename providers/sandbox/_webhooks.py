"""Signed webhook events of the sandbox (Standard Webhooks scheme) and their delivery."""

from __future__ import annotations

import base64
import json
import logging
import queue
import secrets
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from standardwebhooks.webhooks import Webhook

from ._ledger import Clock

__all__ = ["Outbox", "WebhookDelivery", "generate_secret"]

log = logging.getLogger(__name__)

DELIVERY_ATTEMPTS = 3
DELIVERY_TIMEOUT = httpx.Timeout(connect=1.0, read=2.0, write=2.0, pool=1.0)
RETRY_BASE_DELAY = 0.05  # seconds, doubled per attempt


def generate_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode("ascii")


@dataclass(frozen=True)
class WebhookDelivery:
    headers: dict[str, str]
    body: bytes
    event_id: str
    event_type: str


class Outbox:
    """Builds, signs and keeps every event; posts them to ``url`` from one thread if set."""

    def __init__(
        self, *, secret: str, clock: Clock, url: str | None, stop: threading.Event
    ) -> None:
        self._signer = Webhook(secret)  # fails early on a secret that is not base64
        self._clock = clock
        self._url = url
        self._stop = stop
        self._lock = threading.Lock()
        self._deliveries: list[WebhookDelivery] = []
        self._queue: queue.SimpleQueue[WebhookDelivery | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.failed = 0

    def emit(self, effect: dict[str, Any]) -> WebhookDelivery:
        event_id = f"evt_{secrets.token_hex(12)}"
        event_type = f"effect.{effect['status']}"
        event = {
            "id": event_id,
            "type": event_type,
            "created": int(self._clock.wall()),
            "data": effect,
        }
        payload = json.dumps(event, separators=(",", ":"), sort_keys=True)
        # Signed with the real time, not the movable clock: the receiver checks the
        # timestamp against its own clock, and advancing the sandbox to pass an idempotency
        # window must not make every later webhook look forged.
        signed_at = datetime.now(UTC)
        headers = {
            "content-type": "application/json",
            "webhook-id": event_id,
            "webhook-timestamp": str(int(signed_at.timestamp())),
            "webhook-signature": self._signer.sign(event_id, signed_at, payload),
        }
        delivery = WebhookDelivery(
            headers=headers, body=payload.encode(), event_id=event_id, event_type=event_type
        )
        with self._lock:
            self._deliveries.append(delivery)
        if self._url is not None:
            self._queue.put(delivery)
        return delivery

    def deliveries(self) -> list[WebhookDelivery]:
        with self._lock:
            return list(self._deliveries)

    def start(self) -> None:
        if self._url is None or self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, args=(self._url,), name="sandbox-webhooks", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float) -> None:
        if self._thread is None:
            return
        self._queue.put(None)  # wakes the sender; it drops what is left once stop is set
        self._thread.join(timeout)
        self._thread = None

    def _run(self, url: str) -> None:
        with httpx.Client(timeout=DELIVERY_TIMEOUT) as client:
            while True:
                item = self._queue.get()
                if item is None or self._stop.is_set():
                    return
                if self._deliver(client, url, item):
                    self.sent += 1
                else:
                    self.failed += 1

    def _deliver(self, client: httpx.Client, url: str, delivery: WebhookDelivery) -> bool:
        for attempt in range(DELIVERY_ATTEMPTS):
            if attempt and self._stop.wait(RETRY_BASE_DELAY * 2**attempt):
                return False
            try:
                response = client.post(url, content=delivery.body, headers=delivery.headers)
            except httpx.HTTPError as exc:
                # A receiver that is down must not take the sandbox down with it.
                log.debug("webhook %s attempt %d failed: %s", delivery.event_id, attempt, exc)
                continue
            if response.is_success:
                return True
            log.debug("webhook %s answered %d", delivery.event_id, response.status_code)
        return False
