"""Stripe webhook verification and parsing.

The ``Stripe-Signature`` header (``t=<unix time>,v1=<hex HMAC-SHA256 of "{t}.{body}">``, with
several ``v1`` entries while a secret is rolled) is Stripe's documented scheme: an HMAC the
standard library computes, compared in constant time, so the adapter does not need the
``stripe`` package. The timestamp must be within ``tolerance`` of now (replay protection).

Events are mapped to the operation they concern: by ``request.idempotency_key`` when one of
our downstream keys caused the event (a capture's ``payment_intent.succeeded`` concerns the
capture; the cancel a void sent, under the void's key, concerns the ``payment.create`` it
voids), else by the provider reference (or, for objects made before keys came from the
namespace, the ``payorch_operation_id`` metadata). Their outcome is read with
the functions the status query uses (:mod:`._classify`), so both paths agree: a decline carries
the same code, and a ``payment_intent.canceled`` that releases a manual-capture authorisation
is what became of a successful ``payment.create`` (lifecycle evidence), not its decline;
while a void of that operation is wanted, the webhook handler reads it as the void's outcome.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from ...core import downstream_key as namespace_downstream_key
from ...core import is_namespace_key, operation_id_from_downstream_key
from ...errors import WebhookMalformed, WebhookSignatureInvalid
from ...provider import TAG_LEGACY_OPERATION_ID, TAG_REF, AnswerKind, WebhookEvent
from ._classify import AUTHORIZATION_RELEASED, REFUND_KINDS, authorization_released, decline_code

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
_REF = re.compile(r"[0-9a-f]{32}")  # payorch.core.namespace_ref's form
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


def _verify(
    headers: Mapping[str, str],
    body: bytes,
    secret: str,
    tolerance: timedelta,
    now: float | None = None,
) -> None:
    header = _header(headers, SIGNATURE_HEADER)
    if not header:
        raise WebhookSignatureInvalid(f"missing {SIGNATURE_HEADER} header")
    timestamp: int | None = None
    signatures: list[str] = []
    for item in header.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep:
            continue
        if name == "t":
            try:
                timestamp = int(value)
            except ValueError:
                raise WebhookSignatureInvalid(f"{SIGNATURE_HEADER}: bad timestamp") from None
        elif name == "v1":
            signatures.append(value)
    if timestamp is None or not signatures:
        raise WebhookSignatureInvalid(f"{SIGNATURE_HEADER}: no timestamp or no v1 signature")
    signed = str(timestamp).encode() + b"." + body
    expected = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
    # Every v1 entry is tried: while a secret is rolled, Stripe signs with both.
    if not any(hmac.compare_digest(expected, s) for s in signatures if s.isascii()):
        raise WebhookSignatureInvalid(f"{SIGNATURE_HEADER}: no matching v1 signature")
    age = (time.time() if now is None else now) - timestamp
    if tolerance.total_seconds() > 0 and abs(age) > tolerance.total_seconds():
        raise WebhookSignatureInvalid(f"{SIGNATURE_HEADER}: timestamp outside the tolerance")


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


def _voided_key(key: str) -> str:
    """The key of the operation that a void key (``payorch:<ref>:void``,
    ``VoidRequest.void_key``) voids, so the cancel our void caused finds that operation even
    before its reference is stored; any other key as it is."""
    if is_namespace_key(key) and key.endswith(":void"):
        return namespace_downstream_key(key.split(":")[1])
    return key


def _outcome(
    event_type: str, obj: Mapping[str, Any]
) -> tuple[AnswerKind | None, str | None, str | None]:
    """The event's outcome, a decline's code, and a lifecycle note (or None for each)."""
    kind: AnswerKind | None = None
    if event_type in _PAYMENT_EVENTS:
        if obj.get("object") != "payment_intent":
            raise WebhookMalformed(f"{event_type} does not carry a payment_intent")
        if event_type == "payment_intent.canceled" and authorization_released(obj):
            # The payment.create it concerns did succeed (it was authorised); the release is
            # what became of the hold afterwards, as a status query would also read it.
            return AnswerKind.SUCCEEDED, None, AUTHORIZATION_RELEASED
        kind = _PAYMENT_EVENTS[event_type]
    elif event_type in _REFUND_EVENTS:
        if obj.get("object") != "refund":
            raise WebhookMalformed(f"{event_type} does not carry a refund")
        status = obj.get("status")
        kind = REFUND_KINDS.get(status) if isinstance(status, str) else None
    code = decline_code(obj) if kind is AnswerKind.DECLINED else None
    return kind, code, None


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
    downstream_key = _idempotency_key(event.get("request"))
    # The operation whose call caused the event, else the one that created the object (its
    # metadata: a capture's intent carries its payment.create's tags). An event nobody's
    # call of ours caused (a cancel in the dashboard, an expiry, a late failure) names the
    # creating operation by the namespace ref it was tagged with.
    ours = downstream_key is not None and (
        is_namespace_key(downstream_key) or operation_id_from_downstream_key(downstream_key)
    )
    ref = _text(metadata.get(TAG_REF)) if isinstance(metadata, dict) else None
    if not ours and ref is not None and _REF.fullmatch(ref):
        downstream_key = namespace_downstream_key(ref)
    elif ours and downstream_key is not None:
        downstream_key = _voided_key(downstream_key)
    operation_id = operation_id_from_downstream_key(downstream_key) if downstream_key else None
    if operation_id is None and isinstance(metadata, dict):
        operation_id = _text(metadata.get(TAG_LEGACY_OPERATION_ID))
    outcome, code, lifecycle = _outcome(event_type, obj)
    return WebhookEvent(
        event_id=event_id,
        event_type=event_type,
        outcome=outcome,
        provider_reference=_text(obj.get("id")),
        downstream_key=downstream_key,
        operation_id=operation_id,
        occurred_at=_occurred_at(event.get("created")),
        body=event,
        code=code,
        lifecycle=lifecycle,
    )
