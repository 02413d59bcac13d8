"""The Stripe adapter's webhooks: signatures, tolerance, malformed bodies, event outcomes."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import respx
from stripe_helpers import API_KEY, KEY, OP_ID, PI_ID, RE_ID, SECRET, payment_intent, refund

from payorch.errors import ConfigurationError, WebhookMalformed, WebhookSignatureInvalid
from payorch.provider import AnswerKind
from payorch.providers.stripe import SIGNATURE_HEADER, StripeProvider

# -- webhooks ----------------------------------------------------------------------------------


def event(event_type: str = "payment_intent.succeeded", obj: dict[str, Any] | None = None) -> bytes:
    body = {
        "id": "evt_3MtwBwLkdIwHu7ix0Yk5dQbc",
        "object": "event",
        "api_version": "2024-06-20",
        "created": 1680800510,
        "data": {"object": obj if obj is not None else payment_intent("succeeded")},
        "livemode": False,
        "pending_webhooks": 1,
        "request": {"id": "req_2bCvXf9dQkq9Ls", "idempotency_key": KEY},
        "type": event_type,
    }
    return json.dumps(body, separators=(",", ":")).encode()


def sign(body: bytes, *, secret: str = SECRET, timestamp: int | None = None) -> str:
    t = int(time.time()) if timestamp is None else timestamp
    signed = f"{t}.".encode() + body
    digest = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
    return f"t={t},v1={digest}"


def test_webhook_valid_signature_is_parsed(stripe: StripeProvider) -> None:
    body = event()
    parsed = stripe.parse_webhook({SIGNATURE_HEADER: sign(body)}, body)
    assert parsed.event_id == "evt_3MtwBwLkdIwHu7ix0Yk5dQbc"
    assert parsed.event_type == "payment_intent.succeeded"
    assert parsed.outcome is AnswerKind.SUCCEEDED
    assert parsed.provider_reference == PI_ID
    assert parsed.operation_id == OP_ID
    assert parsed.downstream_key == KEY
    assert parsed.occurred_at == datetime.fromtimestamp(1680800510, tz=UTC)
    assert parsed.body["id"] == parsed.event_id


def test_webhook_header_name_is_case_insensitive(stripe: StripeProvider) -> None:
    body = event()
    parsed = stripe.parse_webhook({"stripe-signature": sign(body)}, body)
    assert parsed.outcome is AnswerKind.SUCCEEDED


def test_webhook_accepts_any_of_several_signatures(stripe: StripeProvider) -> None:
    body = event()
    rolled = sign(body, secret="whsec_old_secret")
    current = sign(body).split(",")[1]
    parsed = stripe.parse_webhook({SIGNATURE_HEADER: f"{rolled},{current}"}, body)
    assert parsed.event_id.startswith("evt_")


def test_webhook_tampered_body_is_rejected(stripe: StripeProvider) -> None:
    body = event()
    header = sign(body)
    tampered = body.replace(b'"succeeded"', b'"canceled"')
    with pytest.raises(WebhookSignatureInvalid):
        stripe.parse_webhook({SIGNATURE_HEADER: header}, tampered)


def test_webhook_wrong_secret_is_rejected(stripe: StripeProvider) -> None:
    body = event()
    with pytest.raises(WebhookSignatureInvalid):
        stripe.parse_webhook({SIGNATURE_HEADER: sign(body, secret="whsec_someone_else")}, body)


def test_webhook_stale_timestamp_is_rejected(stripe: StripeProvider) -> None:
    body = event()
    stale = int(time.time()) - 6 * 60  # tolerance is 5 minutes
    with pytest.raises(WebhookSignatureInvalid, match="tolerance"):
        stripe.parse_webhook({SIGNATURE_HEADER: sign(body, timestamp=stale)}, body)


def test_webhook_tolerance_is_configurable(router: respx.Router) -> None:
    body = event()
    header = sign(body, timestamp=int(time.time()) - 6 * 60)
    with StripeProvider(
        api_key=API_KEY,
        webhook_secret=SECRET,
        webhook_tolerance=timedelta(minutes=10),
        transport=httpx.MockTransport(router.handler),
    ) as stripe:
        assert (
            stripe.parse_webhook({SIGNATURE_HEADER: header}, body).outcome is AnswerKind.SUCCEEDED
        )


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {SIGNATURE_HEADER: ""},
        {SIGNATURE_HEADER: "garbage"},
        {SIGNATURE_HEADER: "t=notanumber,v1=abc"},
        {SIGNATURE_HEADER: f"t={int(time.time())},v0=abc"},
        {SIGNATURE_HEADER: f"t={int(time.time())},v1=ünïcode"},
    ],
)
def test_webhook_missing_or_malformed_header_is_rejected(
    stripe: StripeProvider, headers: dict[str, str]
) -> None:
    with pytest.raises(WebhookSignatureInvalid):
        stripe.parse_webhook(headers, event())


def test_webhook_non_utf8_body_is_rejected(stripe: StripeProvider) -> None:
    # The signature covers the raw bytes; a signed body that is not UTF-8 JSON is malformed.
    body = b"\xff\xfe not utf-8"
    with pytest.raises(WebhookMalformed):
        stripe.parse_webhook({SIGNATURE_HEADER: sign(body)}, body)


@pytest.mark.parametrize(
    "body",
    [
        b"not json at all",
        b"[1, 2, 3]",
        json.dumps({"id": "evt_1", "object": "event", "type": "payment_intent.succeeded"}).encode(),
        json.dumps({"id": "evt_1", "object": "v2.core.event", "type": "x"}).encode(),
        event("payment_intent.succeeded", refund()),
        event("refund.updated", payment_intent()),
        event().replace(b'"created":1680800510', b'"created":"yesterday"'),
    ],
)
def test_webhook_signed_but_malformed(stripe: StripeProvider, body: bytes) -> None:
    with pytest.raises(WebhookMalformed):
        stripe.parse_webhook({SIGNATURE_HEADER: sign(body)}, body)


@pytest.mark.parametrize(
    ("event_type", "kind"),
    [
        ("payment_intent.succeeded", AnswerKind.SUCCEEDED),
        ("payment_intent.amount_capturable_updated", AnswerKind.SUCCEEDED),
        ("payment_intent.payment_failed", AnswerKind.DECLINED),
        ("payment_intent.canceled", AnswerKind.DECLINED),
        ("payment_intent.processing", AnswerKind.PENDING),
        ("payment_intent.created", None),
        ("customer.created", None),
    ],
)
def test_webhook_payment_intent_events(
    stripe: StripeProvider, event_type: str, kind: AnswerKind | None
) -> None:
    obj = (
        payment_intent()
        if event_type.startswith("payment_intent")
        else {"id": "cus_1", "object": "customer"}
    )
    body = event(event_type, obj)
    parsed = stripe.parse_webhook({SIGNATURE_HEADER: sign(body)}, body)
    assert parsed.outcome is kind
    assert parsed.event_type == event_type


@pytest.mark.parametrize(
    "event_type", ["refund.created", "refund.updated", "charge.refund.updated"]
)
@pytest.mark.parametrize(
    ("status", "kind"),
    [
        ("succeeded", AnswerKind.SUCCEEDED),
        ("pending", AnswerKind.PENDING),
        ("requires_action", AnswerKind.PENDING),
        ("failed", AnswerKind.DECLINED),
        ("canceled", AnswerKind.DECLINED),
    ],
)
def test_webhook_refund_events_follow_refund_status(
    stripe: StripeProvider, event_type: str, status: str, kind: AnswerKind
) -> None:
    body = event(event_type, refund(status))
    parsed = stripe.parse_webhook({SIGNATURE_HEADER: sign(body)}, body)
    assert (parsed.outcome, parsed.provider_reference, parsed.operation_id) == (kind, RE_ID, OP_ID)


def test_webhook_without_secret_is_a_configuration_error(router: respx.Router) -> None:
    body = event()
    transport = httpx.MockTransport(router.handler)
    with (
        StripeProvider(api_key=API_KEY, transport=transport) as stripe,
        pytest.raises(ConfigurationError, match="webhook_secret"),
    ):
        stripe.parse_webhook({SIGNATURE_HEADER: sign(body)}, body)
