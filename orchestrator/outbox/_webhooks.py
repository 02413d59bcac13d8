"""Outbound webhooks signed per Standard Webhooks, and the receiver's check of them.

:class:`WebhookSink` POSTs each outbox message to its tenant's endpoint. The body is the
spec's recommended shape, ``{"type", "timestamp", "data"}``, where ``timestamp`` is when the
message was staged (ISO 8601, UTC): the same bytes on every attempt. The headers are
``webhook-id`` (the message id, the same on every attempt: what a receiver dedupes on),
``webhook-timestamp`` (this attempt, Unix seconds, by the database's clock carried
forward from the relay's lease, :meth:`~payorch.outbox.OutboxMessage.now`, never the
relay host's wall clock) and ``webhook-signature``
(``v1,<base64 HMAC-SHA256 of "id.timestamp.body">``, made by the ``standardwebhooks``
package). A 2xx is delivered; anything else, a transport error or the deadline is
:class:`~payorch.errors.DeliveryFailed` with a short reason (``http_410``,
``ConnectTimeout``). The sink never retries by itself: the relay counts attempts, backs off
and dead-letters.

:func:`verify_webhook` is the receiving end: it checks the signature and the timestamp's
tolerance (five minutes, the library's) and returns the parsed body.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from standardwebhooks.webhooks import (
    EmptyWebhookSecretError,
    Webhook,
    WebhookVerificationError,
)

from ..clients import HttpClients, call_budget, parse_retry_after, send_with_deadline
from ..errors import (
    ConfigurationError,
    DeliveryFailed,
    WebhookMalformed,
    WebhookSignatureInvalid,
)
from ._sinks import OutboxMessage

__all__ = [
    "DEFAULT_TIMEOUT",
    "WebhookEndpoint",
    "WebhookSink",
    "verify_webhook",
    "webhook_body",
]

# The spec recommends a request time-out of 15 to 30 s: the default deadline, every phase
# added up, is 15 s (a receiver should queue its work and answer at once).
DEFAULT_TIMEOUT = httpx.Timeout(connect=2.0, read=10.0, write=2.0, pool=1.0)

_PREFIX = "whsec_"
# Standard Webhooks: a symmetric secret is random, at least 24 bytes, at most 512 bits.
_MIN_SECRET_BYTES = 24
_MAX_SECRET_BYTES = 64


def _secret_key(secret: object) -> bytes:
    """The key bytes of a ``whsec_<base64>`` secret, or ConfigurationError."""
    if not isinstance(secret, str) or not secret.startswith(_PREFIX):
        raise ConfigurationError("a webhook secret must be 'whsec_' followed by base64")
    encoded = secret[len(_PREFIX) :]
    try:
        # Strict base64 (standardwebhooks itself silently drops stray characters).
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ConfigurationError("a webhook secret must be base64 after 'whsec_'") from exc
    if not _MIN_SECRET_BYTES <= len(key) <= _MAX_SECRET_BYTES:
        raise ConfigurationError(
            f"a webhook secret must decode to {_MIN_SECRET_BYTES} to {_MAX_SECRET_BYTES} "
            f"bytes, not {len(key)}"
        )
    return key


def _signer(secret: str) -> Webhook:
    _secret_key(secret)
    try:
        return Webhook(secret)
    except (ValueError, EmptyWebhookSecretError) as exc:  # refused above already
        raise ConfigurationError("the webhook secret is not valid") from exc


def _check_url(url: object) -> str:
    if not isinstance(url, str):
        raise ConfigurationError(f"a webhook URL must be a string, not {type(url).__name__}")
    try:
        parsed = httpx.URL(url)
        port_ok = parsed.port is None or 0 < parsed.port < 65536
    except (httpx.InvalidURL, ValueError) as exc:
        raise ConfigurationError(f"invalid webhook URL {url!r}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host or not port_ok:
        raise ConfigurationError(f"a webhook URL must be http(s)://host[:port]/…, not {url!r}")
    return url


@dataclass(frozen=True, slots=True)
class WebhookEndpoint:
    """Where one tenant's webhooks go, and the secret they are signed with.

    ``secret`` is a Standard Webhooks secret, ``whsec_`` and the base64 of 24 to 64 random
    bytes. ``previous_secrets`` are also signed with (the header then carries one signature
    per secret), so a receiver can move to a new secret with no failed delivery. A bad URL
    or secret is refused here with :class:`~payorch.errors.ConfigurationError`.
    """

    url: str
    secret: str = field(repr=False)
    previous_secrets: tuple[str, ...] = field(default=(), repr=False)
    _signers: tuple[Webhook, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_url(self.url)
        if isinstance(self.previous_secrets, str):
            raise ConfigurationError("previous_secrets is a tuple of secrets, not one string")
        signers = tuple(_signer(s) for s in (self.secret, *self.previous_secrets))
        object.__setattr__(self, "_signers", signers)

    def signature(self, message_id: str, timestamp: datetime, body: bytes) -> str:
        """The ``webhook-signature`` header: ``v1,<sig>`` per secret, space-separated."""
        text = body.decode("utf-8")
        return " ".join(s.sign(message_id, timestamp, text) for s in self._signers)


def _utc_iso(moment: datetime) -> str:
    if moment.tzinfo is None:  # the store's datetimes are UTC; a naive one is too
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def webhook_body(message: OutboxMessage) -> bytes:
    """The JSON body sent for ``message``: ``{"type", "timestamp", "data"}``, compact UTF-8.

    ``timestamp`` is when the message was staged, not this attempt, so the body is the same
    bytes on every attempt. ``ValueError``/``TypeError`` if the payload has no JSON form.
    """
    document = {
        "type": message.type,
        "timestamp": _utc_iso(message.created_at),
        "data": dict(message.payload),
    }
    text = json.dumps(document, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")


Endpoints = Mapping[str, WebhookEndpoint] | Callable[[str], WebhookEndpoint | None]


class WebhookSink:
    """A :class:`~payorch.outbox.Sink` that POSTs each message to its tenant's endpoint.

    ``endpoints`` maps a tenant id to its :class:`WebhookEndpoint` (copied here), or is a
    function that returns it, asked on every delivery (None: the tenant has none, and its
    messages fail until it has one). Each call runs under ``timeout`` (explicit
    connect/read/write/pool time-outs) and a total ``deadline`` (by default every phase
    added up), whatever the receiver does. ``client`` stays the caller's (used, never
    closed); it must not follow redirects (a 3xx is a failure, per the spec: the
    endpoint's URL is what should change). Safe to call from several threads at once.
    """

    def __init__(
        self,
        endpoints: Endpoints,
        *,
        client: httpx.Client | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        deadline: timedelta | None = None,
        user_agent: str = "payorch-outbox",
    ) -> None:
        try:
            budget = call_budget(timeout)
        except ValueError as exc:  # a phase left None: nothing would bound it
            raise ConfigurationError(f"webhook time-outs: {exc}") from exc
        self._deadline = deadline if deadline is not None else budget
        seconds = self._deadline.total_seconds()
        if not (math.isfinite(seconds) and seconds > 0):
            raise ConfigurationError(f"the webhook deadline must be positive, not {deadline!r}")
        if client is not None and client.follow_redirects:
            raise ConfigurationError("a webhook client must not follow redirects")
        if isinstance(endpoints, Mapping):
            for tenant, endpoint in endpoints.items():
                if not isinstance(endpoint, WebhookEndpoint):
                    raise ConfigurationError(
                        f"tenant {tenant!r}: expected a WebhookEndpoint, not "
                        f"{type(endpoint).__name__}"
                    )
            mapping = dict(endpoints)
            self._endpoint_of: Callable[[str], WebhookEndpoint | None] = mapping.get
        elif callable(endpoints):
            self._endpoint_of = endpoints
        else:
            raise ConfigurationError("endpoints must be a mapping or a function of the tenant")
        self._timeout = timeout
        self._user_agent = user_agent
        self._clients = HttpClients(timeout=timeout, client=client)

    @property
    def deadline(self) -> float:
        """The longest one delivery can take, in seconds: the relay checks at start-up
        that its lease outlasts a batch of them."""
        return self._deadline.total_seconds()

    def deliver(self, message: OutboxMessage) -> None:
        """POST ``message``; return on a 2xx, else raise DeliveryFailed."""
        endpoint = self._endpoint_of(message.tenant_id)
        if endpoint is None:
            raise DeliveryFailed(f"no webhook endpoint for tenant {message.tenant_id!r}")
        if not message.id or "." in message.id:
            # The signed content is "id.timestamp.body": a dot in the id would make it
            # ambiguous, so the spec forbids it.
            raise DeliveryFailed(f"message id {message.id!r} is empty or contains '.'")
        try:
            body = webhook_body(message)
        except (TypeError, ValueError) as exc:
            raise DeliveryFailed(f"payload has no JSON form: {exc}") from exc
        request = self._request(endpoint, message.id, body, message.now())
        try:
            response = send_with_deadline(
                self._clients.sync, request, deadline=time.monotonic() + self.deadline
            )
        except httpx.HTTPError as exc:  # DeadlineExceeded included (a TimeoutException)
            raise DeliveryFailed(type(exc).__name__) from exc
        if not 200 <= response.status_code < 300:
            raise DeliveryFailed(
                f"http_{response.status_code}",
                # NaN when it named no delay: DeliveryFailed then leaves the backoff to decide.
                retry_after=parse_retry_after(response.headers.get("retry-after"), math.nan),
            )

    def close(self) -> None:
        """Close the HTTP client if it was built here."""
        self._clients.close()

    def _request(
        self, endpoint: WebhookEndpoint, message_id: str, body: bytes, moment: datetime
    ) -> httpx.Request:
        # ``moment``: the database's time, from the relay's lease (OutboxMessage.now), not
        # this host's clock, which receivers (five minutes' tolerance) would refuse if it ran
        # fast or slow. Whole seconds: the header is integer Unix time, and the signature
        # must cover the same value the header carries.
        now = datetime.fromtimestamp(int(moment.timestamp()), tz=UTC)
        headers = {
            "content-type": "application/json",
            "user-agent": self._user_agent,
            "webhook-id": message_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": endpoint.signature(message_id, now, body),
        }
        # The time-out goes on the request too, so a caller's client cannot loosen it.
        return self._clients.sync.build_request(
            "POST", endpoint.url, content=body, headers=headers, timeout=self._timeout
        )


def verify_webhook(body: bytes | str, headers: Mapping[str, str], secret: str) -> dict[str, Any]:
    """Check a received webhook's signature and return its parsed body.

    ``body`` is the raw request body, exactly as received (never re-serialised JSON);
    ``headers`` holds ``webhook-id``, ``webhook-timestamp`` and ``webhook-signature`` (any
    case). A missing or wrong signature, or a timestamp more than five minutes away from
    now, raises :class:`~payorch.errors.WebhookSignatureInvalid`; a verified body that is
    not a JSON object with a string ``type`` raises :class:`~payorch.errors.WebhookMalformed`.
    A bad ``secret`` is a :class:`~payorch.errors.ConfigurationError`.

    The same message may arrive more than once (a lost answer, a relay restarted): apply
    its effect once per ``webhook-id``.
    """
    webhook = _signer(secret)
    try:
        webhook.verify(body, dict(headers.items()), json_parse=False)
    except (WebhookVerificationError, ValueError) as exc:
        # ValueError: a garbled header (no comma, bad base64) or a body not UTF-8.
        raise WebhookSignatureInvalid(f"webhook signature not valid: {exc}") from exc
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise WebhookMalformed("a webhook body that is not JSON") from exc
    if not isinstance(parsed, dict) or not isinstance(parsed.get("type"), str):
        raise WebhookMalformed("a webhook body must be a JSON object with a string 'type'")
    return parsed
