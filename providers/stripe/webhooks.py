"""Stripe webhook verification and parsing.

The ``Stripe-Signature`` header (``t=<unix time>,v1=<hex HMAC-SHA256 of "{t}.{body}">``, with
several ``v1`` entries while a secret is rolled) is checked by the ``stripe`` package itself,
so the comparison stays constant-time and in step with Stripe's scheme.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import stripe

from orchestrator.errors import WebhookMalformed, WebhookSignatureInvalid
from orchestrator.provider import AnswerKind, WebhookEvent

from .classify import REFUND_KINDS

__all__ = ["SIGNATURE_HEADER", "parse_stripe_webhook"]

SIGNATURE_HEADER = "Stripe-Signature"

_PAYMENT_EVENTS: Mapping[str, AnswerKind] = {
    "payment_intent.succeeded": AnswerKind.SUCCEEDED,
    # The authorisation of a manual-capture payment.create (status requires_capture).
    "payment_intent.amount_capturable_updated": AnswerKind.SUCCEEDED,
    "payment_intent.payment_failed": AnswerKind.DECLINED,
    "payment_intent.canceled": AnswerKind.DECLINED,
    "payment_intent.processing": AnswerKind.PENDING,
}
# Their data.object is a Refund; the outcome is its status.
_REFUND_EVENTS = frozenset(
    {"refund.created", "refund.updated", "refund.failed", "charge.refund.updated"}
)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    # Plain dicts are case-sensitive; HTTP header names are not.
    wanted = name.lower()
    for key, value in headers.items():
        if key.lower() == wanted:
            return value
    return None


def _verify(headers: Mapping[str, str], body: bytes, secret: str, tolerance: timedelta) -> None:
    header = _header(headers, SIGNATURE_HEADER)
    if not header:
        raise WebhookSignatureInvalid(f"missing {SIGNATURE_HEADER} header")
    try:
        stripe.WebhookSignature.verify_header(body, header, secret, tolerance.total_seconds())
    except stripe.SignatureVerificationError as exc:
        # Covers a malformed header, no matching v1 signature and a stale timestamp.
        raise WebhookSignatureInvalid(f"{SIGNATURE_HEADER} rejected: {exc.user_message}") from exc
    except (ValueError, TypeError) as exc:
        # The library decodes the body as UTF-8 and compares str digests, which refuses
        # non-ASCII: either way the signature cannot be Stripe's.
        raise WebhookSignatureInvalid(
            f"{SIGNATURE_HEADER} could not be verified: {type(exc).__name__}"
        ) from exc


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _occurred_at(created: object) -> datetime | None:
    if created is None:
        return None
    if not isinstance(created, int) or isinstance(created, bool):
        raise WebhookMalformed("event 'created' is not a Unix timestamp")
    try:
        return datetime.fromtimestamp(created, tz=UTC)
    except (OverflowError, OSError, ValueError) as exc:
        raise WebhookMalformed("event 'created' is out of range") from exc


def _idempotency_key(request: object) -> str | None:
    # Since API version 2017-05-25, "request" is {"id", "idempotency_key"}: the key of the API
    # call that caused the event, i.e. our downstream key when we caused it.
    return _text(request.get("idempotency_key")) if isinstance(request, dict) else None


def _outcome(event_type: str, obj: Mapping[str, Any]) -> AnswerKind | None:
    if event_type in _PAYMENT_EVENTS:
        if obj.get("object") != "payment_intent":
            raise WebhookMalformed(f"{event_type} does not carry a payment_intent")
        return _PAYMENT_EVENTS[event_type]
    if event_type in _REFUND_EVENTS:
        if obj.get("object") != "refund":
            raise WebhookMalformed(f"{event_type} does not carry a refund")
        status = obj.get("status")
        return REFUND_KINDS.get(status) if isinstance(status, str) else None
    return None


def parse_stripe_webhook(
    headers: Mapping[str, str], body: bytes, *, secret: str, tolerance: timedelta
) -> WebhookEvent:
    """Verify ``body`` against its ``Stripe-Signature`` and reduce the event to a WebhookEvent.

    Raises WebhookSignatureInvalid (missing header, bad signature, timestamp older than
    ``tolerance``) before looking at the body, and WebhookMalformed for a verified body that is
    not a Stripe event. Event types that move no operation get ``outcome=None``.
    """
    _verify(headers, body, secret, tolerance)
    try:
        event = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise WebhookMalformed("webhook body is not JSON") from exc
    if not isinstance(event, dict) or event.get("object", "event") != "event":
        raise WebhookMalformed("webhook body is not a Stripe event object")
    event_id = _text(event.get("id"))
    event_type = _text(event.get("type"))
    data = event.get("data")
    obj = data.get("object") if isinstance(data, dict) else None
    if event_id is None or event_type is None or not isinstance(obj, dict):
        raise WebhookMalformed("Stripe event lacks id, type or data.object")
    metadata = obj.get("metadata")
    return WebhookEvent(
        event_id=event_id,
        event_type=event_type,
        outcome=_outcome(event_type, obj),
        provider_reference=_text(obj.get("id")),
        downstream_key=_idempotency_key(event.get("request")),
        operation_id=_text(metadata.get("payorch_operation_id"))
        if isinstance(metadata, dict)
        else None,
        occurred_at=_occurred_at(event.get("created")),
        body=event,
    )
