"""Signed webhook events of the sandbox (Standard Webhooks scheme) and their delivery.

Every event is kept (``deliveries()``); with target URLs set, one thread posts each event
to each target, ``delay`` seconds after it happened (an acquirer's notifications lag its
answers), retrying a few times. A target may name the tenant, ``{tenant}``, filled in from
the effect's ``payorch_tenant_id`` tag: payorch's webhook routes are per tenant. A post
that fails in any way counts as failed and the thread goes on with the next; at most
``MAX_WAITING`` events wait at a time (more count as failed for every target).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import httpx
from standardwebhooks.webhooks import Webhook

from ...provider import TAG_TENANT
from ._ledger import Clock

__all__ = [
    "MAX_DELAY",
    "MAX_WAITING",
    "TENANT_PLACEHOLDER",
    "Outbox",
    "WebhookDelivery",
    "check_target",
    "generate_secret",
    "target_url",
]

log = logging.getLogger(__name__)

DELIVERY_ATTEMPTS = 3
DELIVERY_TIMEOUT = httpx.Timeout(connect=1.0, read=2.0, write=2.0, pool=1.0)
RETRY_BASE_DELAY = 0.05  # seconds, doubled per attempt
MAX_DELAY = 86_400.0  # seconds an event may wait before it is posted: one day
# Events waiting to be posted at most: a long delay under load must not eat the memory.
MAX_WAITING = 10_000
TENANT_PLACEHOLDER = "{tenant}"
# What a pre-namespace request carried instead of the payorch_tenant_id tag.
_LEGACY_TENANT = "tenant_id"


def check_target(url: str) -> str:
    """The host of ``url``; ValueError unless it is an http(s) URL with a host and a valid
    port (1..65535), ``{tenant}`` its only placeholder."""
    filled = url.replace(TENANT_PLACEHOLDER, "t")
    if "{" in filled or "}" in filled:
        raise ValueError(f"webhook URL {url!r}: the only placeholder is {TENANT_PLACEHOLDER}")
    # Parsed as the sender will parse it: what passes here cannot fail to parse there.
    try:
        parsed = httpx.URL(filled)
    except httpx.InvalidURL as exc:
        raise ValueError(f"webhook URL {url!r} is not http(s)://host[:port]/path: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"webhook URL {url!r} is not http(s)://host[:port]/path")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise ValueError(f"webhook URL {url!r}: the port must be within 1..65535")
    return parsed.host


def target_url(template: str, effect: dict[str, Any]) -> str | None:
    """``template`` with ``{tenant}`` filled from the effect's tags; None without a tenant."""
    if TENANT_PLACEHOLDER not in template:
        return template
    metadata = effect.get("metadata")
    tags = metadata if isinstance(metadata, dict) else {}
    tenant = tags.get(TAG_TENANT) or tags.get(_LEGACY_TENANT)
    if not isinstance(tenant, str) or not tenant:
        return None
    return template.replace(TENANT_PLACEHOLDER, quote(tenant, safe=""))


def generate_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode("ascii")


@dataclass(frozen=True)
class WebhookDelivery:
    headers: dict[str, str]
    body: bytes
    event_id: str
    event_type: str


@dataclass(frozen=True)
class _Queued:
    delivery: WebhookDelivery
    effect: dict[str, Any]
    due: float  # time.monotonic() when it may be posted
    seq: int  # emission order, for flush()


class Outbox:
    """Builds, signs and keeps every event; posts them to ``urls`` from one thread if set."""

    def __init__(
        self,
        *,
        secret: str,
        clock: Clock,
        url: str | Sequence[str] | None,
        stop: threading.Event,
        delay: float = 0.0,
    ) -> None:
        self._signer = Webhook(secret)  # fails early on a secret that is not base64
        self._clock = clock
        self._urls: tuple[str, ...] = (url,) if isinstance(url, str) else tuple(url or ())
        for target in self._urls:
            check_target(target)
        if not (math.isfinite(delay) and 0.0 <= delay <= MAX_DELAY):
            raise ValueError(f"webhook_delay must be within 0..{MAX_DELAY:g} seconds")
        self._delay = delay
        self._stop = stop
        self._lock = threading.Lock()
        # Wakes the sender when it waits out a delay: flush() or stop().
        self._wake = threading.Condition(self._lock)
        self._flushed = 0  # events up to this seq are due now
        self._deliveries: list[WebhookDelivery] = []
        self._queue: queue.SimpleQueue[_Queued | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._waiting = 0
        self._sent = 0
        self._failed = 0
        self._overflowing = False  # the queue is full: warned once until it drains

    @property
    def urls(self) -> tuple[str, ...]:
        return self._urls

    @property
    def delay(self) -> float:
        return self._delay

    @property
    def sent(self) -> int:
        """Posts a target accepted (2xx)."""
        with self._lock:
            return self._sent

    @property
    def failed(self) -> int:
        """Posts that failed every attempt or with an error that a retry cannot mend, had no
        tenant for a ``{tenant}`` target, or were dropped as ``MAX_WAITING`` events waited."""
        with self._lock:
            return self._failed

    def stats(self) -> dict[str, int]:
        """Events made, posts accepted and failed, and events still waiting to be posted."""
        with self._lock:
            return {
                "events": len(self._deliveries),
                "sent": self._sent,
                "failed": self._failed,
                "waiting": self._waiting,
            }

    def flush(self) -> int:
        """Make every event emitted so far due now (their delay is cut short); how many
        were still waiting."""
        with self._lock:
            self._flushed = len(self._deliveries)
            self._wake.notify_all()
            return self._waiting

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
            if not self._urls:
                return delivery
            if self._waiting >= MAX_WAITING:
                self._failed += len(self._urls)  # one post per target that will not happen
                if not self._overflowing:
                    log.warning(
                        "sandbox webhooks: %d events are waiting; later events are not "
                        "posted (counted as failed) until they drain",
                        MAX_WAITING,
                    )
                self._overflowing = True
                return delivery
            self._overflowing = False
            self._waiting += 1
            due = time.monotonic() + self._delay
            self._queue.put(_Queued(delivery, effect, due, len(self._deliveries)))
        return delivery

    def deliveries(self) -> list[WebhookDelivery]:
        with self._lock:
            return list(self._deliveries)

    def start(self) -> None:
        if not self._urls or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="sandbox-webhooks", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        if self._thread is None:
            return
        self._queue.put(None)  # wakes the sender; it drops what is left once stop is set
        with self._lock:
            self._wake.notify_all()  # ends a delay being waited out
        self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        with httpx.Client(timeout=DELIVERY_TIMEOUT) as client:
            while True:
                item = self._queue.get()
                if item is None or not self._wait_until_due(item):
                    return
                try:
                    for template in self._urls:
                        ok = self._post(client, template, item)
                        with self._lock:
                            if ok:
                                self._sent += 1
                            else:
                                self._failed += 1
                finally:
                    with self._lock:
                        self._waiting -= 1

    def _wait_until_due(self, item: _Queued) -> bool:
        """Wait out ``item``'s delay (flush() cuts it short); False once stopping."""
        with self._lock:
            while not self._stop.is_set() and item.seq > self._flushed:
                left = item.due - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(min(left, threading.TIMEOUT_MAX))
            return not self._stop.is_set()

    def _post(self, client: httpx.Client, template: str, item: _Queued) -> bool:
        """Post ``item`` to one target; False, logged, whatever went wrong."""
        event_id = item.delivery.event_id
        try:
            url = target_url(template, item.effect)
            if url is None:
                log.warning("webhook %s: no tenant for %s", event_id, template)
                return False
            return self._deliver(client, url, item.delivery)
        except Exception as exc:  # one bad post must not stop the sender
            log.warning(
                "webhook %s to %s failed: %s: %s", event_id, template, type(exc).__name__, exc
            )
            log.debug("webhook %s failed", event_id, exc_info=True)
            return False

    def _deliver(self, client: httpx.Client, url: str, delivery: WebhookDelivery) -> bool:
        """True once ``url`` answers 2xx; False after the last attempt. An error other than
        an HTTP one (an unusable URL) is raised: retrying it cannot help."""
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
