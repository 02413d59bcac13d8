"""The Stripe adapter against respx-mocked replies shaped like Stripe's documented ones."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
import respx

from payorch.core import downstream_key, namespace_ref
from payorch.errors import (
    ConfigurationError,
    ProviderIdempotencyError,
    WebhookMalformed,
    WebhookSignatureInvalid,
)
from payorch.provider import AnswerKind, Provider, StatusQuery, SubmitRequest
from payorch.providers.stripe import (
    DEFAULT_TIMEOUT,
    IDEMPOTENCY_WINDOW,
    SIGNATURE_HEADER,
    SUPPORTED_OPERATIONS,
    StripeProvider,
)

BASE = "https://api.stripe.test"
API_KEY = "sk_test_4eC39HqLyjWDarjtT1zdp7dc"
SECRET = "whsec_test_5ZyGQ0lqYzbw0sNLDXNkKfd2TzQ4n7Xh"
OP_ID = "0192c0de-7a1b-7c3d-8e4f-5a6b7c8d9e0f"
TENANT = "tenant-a"
# A downstream key of the earlier form (payorch:<operation id>:…): such operations keep the
# metadata they were first sent with (payorch_operation_id). Today's form: NS_KEY below.
KEY = "payorch:0192c0de-7a1b-7c3d-8e4f-5a6b7c8d9e0f:1"
NS_KEY = downstream_key(namespace_ref(TENANT, "payment.create", "order-17"))
NS_REF = NS_KEY.split(":")[1]
PI_ID = "pi_3MtwBwLkdIwHu7ix28a3tqPa"
RE_ID = "re_1Nispe2eZvKYlo2Cd31jOCgZ"


# -- Stripe-shaped bodies ----------------------------------------------------------------------


def payment_intent(
    status: str = "succeeded",
    *,
    ident: str = PI_ID,
    operation_id: str = OP_ID,
    capture_method: str = "automatic",
    last_payment_error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": ident,
        "object": "payment_intent",
        "amount": 2000,
        "amount_capturable": 2000 if status == "requires_capture" else 0,
        "amount_received": 2000 if status == "succeeded" else 0,
        "automatic_payment_methods": None,
        "canceled_at": None,
        "cancellation_reason": None,
        "capture_method": capture_method,
        "client_secret": f"{ident}_secret_YrKJUKribcBjcG8HVhfZluoGH",
        "confirmation_method": "automatic",
        "created": 1680800504,
        "currency": "usd",
        "customer": "cus_NffrFeUfNV2Hib",
        "description": None,
        "last_payment_error": last_payment_error,
        "latest_charge": "ch_3MtwBwLkdIwHu7ix28a3tqPa",
        "livemode": False,
        "metadata": {
            "payorch_operation": "payment.create",
            "payorch_operation_id": operation_id,
            "payorch_tenant_id": TENANT,
        },
        "next_action": None,
        "payment_method": "pm_1MtwBwLkdIwHu7ixvZ0NQ8mJ",
        "payment_method_types": ["card"],
        "status": status,
    }


def refund(
    status: str = "succeeded", *, ident: str = RE_ID, operation_id: str = OP_ID
) -> dict[str, Any]:
    return {
        "id": ident,
        "object": "refund",
        "amount": 1000,
        "balance_transaction": "txn_1Nispe2eZvKYlo2CYezqFhEx",
        "charge": "ch_1NirD82eZvKYlo2CIvbtLWuY",
        "created": 1692942318,
        "currency": "usd",
        "failure_reason": "expired_or_canceled_card" if status == "failed" else None,
        "metadata": {
            "payorch_operation": "refund.create",
            "payorch_operation_id": operation_id,
            "payorch_tenant_id": TENANT,
        },
        "payment_intent": PI_ID,
        "reason": None,
        "receipt_number": None,
        "source_transfer_reversal": None,
        "status": status,
        "transfer_reversal": None,
    }


def stripe_error(
    error_type: str, message: str, *, code: str | None = None, **extra: Any
) -> dict[str, Any]:
    err: dict[str, Any] = {"type": error_type, "message": message}
    if code is not None:
        err["code"] = code
        err["doc_url"] = f"https://stripe.com/docs/error-codes/{code.replace('_', '-')}"
    err["request_log_url"] = "https://dashboard.stripe.com/test/logs/req_xyz?t=1680800504"
    err.update(extra)
    return {"error": err}


CARD_DECLINED = stripe_error(
    "card_error",
    "Your card has insufficient funds.",
    code="card_declined",
    decline_code="insufficient_funds",
    charge="ch_3MtwBwLkdIwHu7ix0snN0B15",
    payment_intent=payment_intent(
        "requires_payment_method",
        last_payment_error={"code": "card_declined", "decline_code": "insufficient_funds"},
    ),
)


def create_request(**payload: Any) -> SubmitRequest:
    body = {"amount": 2000, "currency": "USD", "payment_method": "pm_card_visa"} | payload
    return SubmitRequest(
        tenant_id=TENANT,
        operation="payment.create",
        operation_id=OP_ID,
        downstream_key=KEY,
        payload=body,
    )


def query(
    operation: str = "payment.create", reference: str | None = PI_ID, **payload: Any
) -> StatusQuery:
    return StatusQuery(
        tenant_id=TENANT,
        operation=operation,
        operation_id=OP_ID,
        downstream_key=KEY,
        provider_reference=reference,
        payload=payload,
    )


def form_of(request: httpx.Request) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(request.content.decode(), strict_parsing=True).items()}


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture
def router() -> respx.Router:
    return respx.Router(base_url=BASE, assert_all_called=False)


@pytest.fixture
def stripe(router: respx.Router) -> Iterator[StripeProvider]:
    with StripeProvider(
        api_key=API_KEY,
        webhook_secret=SECRET,
        base_url=BASE,
        transport=httpx.MockTransport(router.handler),
    ) as provider:
        yield provider


# -- construction ----------------------------------------------------------------------------


def test_declares_the_provider_contract(stripe: StripeProvider) -> None:
    as_provider: Provider = stripe
    assert isinstance(as_provider, Provider)
    assert stripe.name == "stripe"
    assert stripe.idempotency_window == IDEMPOTENCY_WINDOW == timedelta(hours=24)
    # connect 5 + read 30 + write 10 + pool 5
    assert stripe.max_call_duration == timedelta(seconds=50)
    assert sorted(SUPPORTED_OPERATIONS) == ["payment.capture", "payment.create", "refund.create"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"api_key": ""},
        {"webhook_secret": "  "},
        {"timeout": httpx.Timeout(5.0, read=None)},
        {"webhook_tolerance": timedelta(0)},
        {"base_url": "ftp://api.stripe.com"},
        {"base_url": "not a url"},
    ],
)
def test_bad_configuration_is_refused(kwargs: dict[str, Any]) -> None:
    settings: dict[str, Any] = {"api_key": API_KEY} | kwargs
    with pytest.raises(ConfigurationError):
        StripeProvider(**settings)


def test_client_and_transport_together_are_refused(router: respx.Router) -> None:
    transport = httpx.MockTransport(router.handler)
    with httpx.Client(transport=transport) as client, pytest.raises(ConfigurationError):
        StripeProvider(api_key=API_KEY, client=client, transport=transport)


def test_injected_client_is_not_closed_and_adapter_timeouts_apply(router: respx.Router) -> None:
    route = router.post("/v1/payment_intents").mock(
        return_value=httpx.Response(200, json=payment_intent())
    )
    with httpx.Client(transport=httpx.MockTransport(router.handler)) as client:
        with StripeProvider(api_key=API_KEY, base_url=BASE, client=client) as stripe:
            assert stripe.submit(create_request()).kind is AnswerKind.SUCCEEDED
        assert not client.is_closed
    timeout = route.calls.last.request.extensions["timeout"]
    assert timeout == DEFAULT_TIMEOUT.as_dict()


def test_owned_client_is_closed(router: respx.Router) -> None:
    stripe = StripeProvider(api_key=API_KEY, transport=httpx.MockTransport(router.handler))
    stripe.close()
    assert stripe._clients.sync.is_closed


def test_base_url_is_configurable() -> None:
    router = respx.Router(base_url="http://localhost:12111/stripe-mock", assert_all_called=False)
    route = router.post("/v1/payment_intents").mock(
        return_value=httpx.Response(200, json=payment_intent())
    )
    with StripeProvider(
        api_key=API_KEY,
        base_url="http://localhost:12111/stripe-mock/",
        transport=httpx.MockTransport(router.handler),
    ) as stripe:
        answer = stripe.submit(create_request())
    assert answer.kind is AnswerKind.SUCCEEDED
    assert (
        str(route.calls.last.request.url) == "http://localhost:12111/stripe-mock/v1/payment_intents"
    )


def test_default_base_url_is_stripe() -> None:
    with respx.mock(base_url="https://api.stripe.com") as mock:
        route = mock.post("/v1/payment_intents").mock(
            return_value=httpx.Response(200, json=payment_intent())
        )
        with StripeProvider(api_key=API_KEY) as stripe:
            assert stripe.submit(create_request()).kind is AnswerKind.SUCCEEDED
    assert route.calls.last.request.url.host == "api.stripe.com"


# -- request shape ---------------------------------------------------------------------------


def test_payment_create_is_form_encoded_with_metadata(
    stripe: StripeProvider, router: respx.Router
) -> None:
    route = router.post("/v1/payment_intents").mock(
        return_value=httpx.Response(200, json=payment_intent())
    )
    stripe.submit(create_request(customer="cus_NffrFeUfNV2Hib", metadata={"order": "A-17"}))
    request = route.calls.last.request
    assert request.headers["content-type"] == "application/x-www-form-urlencoded"
    assert request.headers["authorization"] == f"Bearer {API_KEY}"
    assert request.headers["idempotency-key"] == KEY
    assert "stripe-version" not in request.headers
    assert b"metadata%5Bpayorch_operation_id%5D=" in request.content
    assert form_of(request) == {
        "amount": "2000",
        "currency": "usd",
        "customer": "cus_NffrFeUfNV2Hib",
        "payment_method": "pm_card_visa",
        "confirm": "true",
        "capture_method": "automatic",
        "metadata[order]": "A-17",
        "metadata[payorch_operation_id]": OP_ID,
        "metadata[payorch_tenant_id]": TENANT,
        "metadata[payorch_operation]": "payment.create",
    }


def test_a_namespace_keyed_create_is_tagged_with_the_namespace_never_the_operation_id(
    stripe: StripeProvider, router: respx.Router
) -> None:
    route = router.post("/v1/payment_intents").mock(
        return_value=httpx.Response(200, json=payment_intent())
    )
    request = SubmitRequest(
        tenant_id=TENANT,
        operation="payment.create",
        operation_id=OP_ID,
        downstream_key=NS_KEY,
        payload={
            "amount": 2000,
            "currency": "USD",
            "payment_method": "pm_card_visa",
            "metadata": {"order": "A-17", "payorch_ref": "spoofed"},
        },
        idempotency_key="order-17",
        fingerprint="f" * 64,
    )
    stripe.submit(request)
    sent = route.calls.last.request
    assert sent.headers["idempotency-key"] == NS_KEY
    metadata = {k: v for k, v in form_of(sent).items() if k.startswith("metadata[")}
    assert metadata == {
        "metadata[order]": "A-17",
        "metadata[payorch_ref]": NS_REF,
        "metadata[payorch_tenant_id]": TENANT,
        "metadata[payorch_operation]": "payment.create",
        "metadata[payorch_idempotency_key]": "order-17",
        "metadata[payorch_fingerprint]": "f" * 64,
    }
    assert OP_ID.encode() not in sent.content  # a re-created claim sends the same bytes


def test_caller_metadata_cannot_spoof_payorch_keys(
    stripe: StripeProvider, router: respx.Router
) -> None:
    route = router.post("/v1/payment_intents").mock(
        return_value=httpx.Response(200, json=payment_intent())
    )
    stripe.submit(create_request(metadata={"payorch_operation_id": "someone-else"}))
    assert form_of(route.calls.last.request)["metadata[payorch_operation_id]"] == OP_ID


def test_manual_capture_and_stripe_version(router: respx.Router) -> None:
    route = router.post("/v1/payment_intents").mock(
        return_value=httpx.Response(200, json=payment_intent("requires_capture"))
    )
    with StripeProvider(
        api_key=API_KEY,
        base_url=BASE,
        transport=httpx.MockTransport(router.handler),
        stripe_version="2024-06-20",
    ) as stripe:
        answer = stripe.submit(create_request(capture_method="manual"))
    request = route.calls.last.request
    assert form_of(request)["capture_method"] == "manual"
    assert request.headers["stripe-version"] == "2024-06-20"
    # The authorisation is the effect a manual-capture payment.create asked for.
    assert answer.kind is AnswerKind.SUCCEEDED


def test_capture_posts_to_the_intent(stripe: StripeProvider, router: respx.Router) -> None:
    route = router.post(f"/v1/payment_intents/{PI_ID}/capture").mock(
        return_value=httpx.Response(200, json=payment_intent("succeeded"))
    )
    request = SubmitRequest(
        tenant_id=TENANT,
        operation="payment.capture",
        operation_id="cap-1",
        downstream_key="cap-key-1",
        payload={"payment_intent": PI_ID, "amount_to_capture": 1500},
    )
    answer = stripe.submit(request)
    sent = route.calls.last.request
    assert form_of(sent) == {"amount_to_capture": "1500"}
    assert sent.headers["idempotency-key"] == "cap-key-1"
    assert answer.kind is AnswerKind.SUCCEEDED
    assert answer.provider_reference == PI_ID


def test_refund_create_form(stripe: StripeProvider, router: respx.Router) -> None:
    route = router.post("/v1/refunds").mock(return_value=httpx.Response(200, json=refund()))
    request = SubmitRequest(
        tenant_id=TENANT,
        operation="refund.create",
        operation_id=OP_ID,
        downstream_key=KEY,
        payload={"payment_intent": PI_ID, "amount": 1000, "reason": "requested_by_customer"},
    )
    answer = stripe.submit(request)
    assert form_of(route.calls.last.request) == {
        "payment_intent": PI_ID,
        "amount": "1000",
        "reason": "requested_by_customer",
        "metadata[payorch_operation_id]": OP_ID,
        "metadata[payorch_tenant_id]": TENANT,
        "metadata[payorch_operation]": "refund.create",
    }
    assert route.calls.last.request.headers["idempotency-key"] == KEY
    assert (answer.kind, answer.provider_reference) == (AnswerKind.SUCCEEDED, RE_ID)


def test_unsupported_operation_is_refused_before_sending(
    stripe: StripeProvider, router: respx.Router
) -> None:
    catch_all = router.route().mock(return_value=httpx.Response(200, json={}))
    request = SubmitRequest(
        tenant_id=TENANT,
        operation="payout.create",
        operation_id=OP_ID,
        downstream_key=KEY,
        payload={"amount": 100, "currency": "usd", "destination": "ba_1"},
    )
    with pytest.raises(ConfigurationError, match=r"payout\.create"):
        stripe.submit(request)
    with pytest.raises(ConfigurationError, match=r"payout\.create"):
        stripe.query_status(query("payout.create"))
    assert not catch_all.called
    assert router.calls.call_count == 0


@pytest.mark.parametrize(
    "payload",
    [
        {"amount": 10.5},
        {"amount": True},
        {"amount": 0},
        {"currency": "dollars"},
        {"capture_method": "later"},
        {"metadata": {"a[b]": "c"}},
    ],
)
def test_invalid_payload_is_declined_without_sending(
    stripe: StripeProvider, router: respx.Router, payload: dict[str, Any]
) -> None:
    catch_all = router.route().mock(return_value=httpx.Response(200, json=payment_intent()))
    answer = stripe.submit(create_request(**payload))
    assert (answer.kind, answer.code) == (AnswerKind.DECLINED, "invalid_payload")
    assert answer.status_code is None
    assert not catch_all.called


def test_capture_refuses_a_path_injection(stripe: StripeProvider, router: respx.Router) -> None:
    catch_all = router.route().mock(return_value=httpx.Response(200, json=payment_intent()))
    request = SubmitRequest(
        tenant_id=TENANT,
        operation="payment.capture",
        operation_id=OP_ID,
        downstream_key=KEY,
        payload={"payment_intent": "pi_1/../../v1/refunds"},
    )
    assert stripe.submit(request).code == "invalid_payload"
    assert not catch_all.called


# -- the same Idempotency-Key on every attempt ------------------------------------------------


@pytest.mark.parametrize(
    ("first", "first_kind"),
    [
        (
            httpx.Response(500, json=stripe_error("api_error", "Something went wrong")),
            AnswerKind.AMBIGUOUS,
        ),
        (
            httpx.Response(
                429,
                headers={"Retry-After": "2"},
                json=stripe_error("invalid_request_error", "Too many requests", code="rate_limit"),
            ),
            AnswerKind.NOT_SENT,
        ),
    ],
)
def test_retry_sends_the_same_idempotency_key_and_body(
    stripe: StripeProvider, router: respx.Router, first: httpx.Response, first_kind: AnswerKind
) -> None:
    route = router.post("/v1/payment_intents").mock(
        side_effect=[first, httpx.Response(200, json=payment_intent())]
    )
    request = create_request()
    first_answer = stripe.submit(request)
    second_answer = stripe.submit(request)
    assert first_answer.kind is first_kind
    assert second_answer.kind is AnswerKind.SUCCEEDED
    keys = [call.request.headers["idempotency-key"] for call in route.calls]
    assert keys == [KEY, KEY]
    assert route.calls[0].request.content == route.calls[1].request.content


def test_transport_retry_keeps_the_key(stripe: StripeProvider, router: respx.Router) -> None:
    route = router.post("/v1/payment_intents").mock(
        side_effect=[
            httpx.ConnectError("connection refused"),
            httpx.Response(200, json=payment_intent()),
        ]
    )
    request = create_request()
    assert stripe.submit(request).kind is AnswerKind.NOT_SENT
    assert stripe.submit(request).kind is AnswerKind.SUCCEEDED
    assert [c.request.headers["idempotency-key"] for c in route.calls] == [KEY, KEY]


# -- classification of submit replies --------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        ("succeeded", AnswerKind.SUCCEEDED),
        ("requires_capture", AnswerKind.SUCCEEDED),
        ("processing", AnswerKind.PENDING),
        ("requires_action", AnswerKind.PENDING),
        ("requires_confirmation", AnswerKind.PENDING),
        ("canceled", AnswerKind.DECLINED),
        ("requires_payment_method", AnswerKind.DECLINED),
        ("some_future_status", AnswerKind.AMBIGUOUS),
    ],
)
def test_payment_intent_status_mapping(
    stripe: StripeProvider, router: respx.Router, status: str, kind: AnswerKind
) -> None:
    body = payment_intent(status)
    router.post("/v1/payment_intents").mock(return_value=httpx.Response(200, json=body))
    answer = stripe.submit(create_request())
    assert answer.kind is kind
    assert answer.provider_reference == PI_ID
    assert answer.status_code == 200
    assert answer.body == body


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
def test_refund_status_mapping(
    stripe: StripeProvider, router: respx.Router, status: str, kind: AnswerKind
) -> None:
    router.post("/v1/refunds").mock(return_value=httpx.Response(200, json=refund(status)))
    request = SubmitRequest(
        tenant_id=TENANT,
        operation="refund.create",
        operation_id=OP_ID,
        downstream_key=KEY,
        payload={"payment_intent": PI_ID},
    )
    answer = stripe.submit(request)
    assert (answer.kind, answer.provider_reference) == (kind, RE_ID)
    if status == "failed":
        assert answer.code == "expired_or_canceled_card"


def test_card_error_is_declined_with_decline_code_and_intent(
    stripe: StripeProvider, router: respx.Router
) -> None:
    router.post("/v1/payment_intents").mock(return_value=httpx.Response(402, json=CARD_DECLINED))
    answer = stripe.submit(create_request())
    assert answer.kind is AnswerKind.DECLINED
    assert answer.code == "insufficient_funds"
    assert answer.provider_reference == PI_ID
    assert answer.status_code == 402
    assert answer.message == "Your card has insufficient funds."
    assert answer.body == CARD_DECLINED


def test_card_error_without_decline_code_uses_code(
    stripe: StripeProvider, router: respx.Router
) -> None:
    body = stripe_error("card_error", "Your card has expired.", code="expired_card")
    router.post("/v1/payment_intents").mock(return_value=httpx.Response(402, json=body))
    answer = stripe.submit(create_request())
    assert (answer.kind, answer.code, answer.provider_reference) == (
        AnswerKind.DECLINED,
        "expired_card",
        None,
    )


def test_idempotency_error_raises(stripe: StripeProvider, router: respx.Router) -> None:
    body = stripe_error(
        "idempotency_error",
        "Keys for idempotent requests can only be used with the same parameters they were "
        f"first used with. Try using a key other than '{KEY}' if you meant to execute a "
        "different request.",
    )
    router.post("/v1/payment_intents").mock(return_value=httpx.Response(400, json=body))
    with pytest.raises(ProviderIdempotencyError, match="different parameters") as caught:
        stripe.submit(create_request())
    assert caught.value.operation_id == OP_ID
    assert KEY in caught.value.message


@pytest.mark.parametrize(
    ("status", "body", "headers", "code"),
    [
        (
            429,
            stripe_error(
                "invalid_request_error",
                "This object cannot be accessed right now because another API request or "
                "Stripe process is currently accessing it.",
                code="lock_timeout",
            ),
            {"Stripe-Should-Retry": "true"},
            "lock_timeout",
        ),
        (
            400,
            stripe_error("invalid_request_error", "Object locked", code="lock_timeout"),
            {},
            "lock_timeout",
        ),
        (
            400,
            stripe_error("invalid_request_error", "Too many requests", code="rate_limit"),
            {},
            "rate_limit",
        ),
        (429, stripe_error("rate_limit_error", "Too many requests"), {}, "rate_limited"),
    ],
)
def test_not_executed_replies_are_not_sent(
    stripe: StripeProvider,
    router: respx.Router,
    status: int,
    body: dict[str, Any],
    headers: dict[str, str],
    code: str,
) -> None:
    router.post("/v1/payment_intents").mock(
        return_value=httpx.Response(status, json=body, headers=headers)
    )
    answer = stripe.submit(create_request())
    assert answer.kind is AnswerKind.NOT_SENT
    assert answer.code == code
    assert answer.retry_after == 1.0
    assert answer.status_code == status
    assert answer.body == body


@pytest.mark.parametrize(
    ("status", "body", "headers", "code"),
    [
        (
            409,
            stripe_error(
                "idempotency_error",
                "There is currently another in-progress request using this Idempotent Key.",
                code="idempotency_key_in_use",
            ),
            {},
            "idempotency_key_in_use",
        ),
        (
            400,
            stripe_error("invalid_request_error", "Try again", code="processing_error"),
            {"Stripe-Should-Retry": "true"},
            "processing_error",
        ),
    ],
)
def test_retry_safe_replies_that_may_follow_an_effect_are_ambiguous(
    stripe: StripeProvider,
    router: respx.Router,
    status: int,
    body: dict[str, Any],
    headers: dict[str, str],
    code: str,
) -> None:
    # Stripe-Should-Retry and a key in use promise that the same key may be retried, not
    # that nothing happened: another request under our key may be moving the money.
    router.post("/v1/payment_intents").mock(
        return_value=httpx.Response(status, json=body, headers=headers)
    )
    answer = stripe.submit(create_request())
    assert answer.kind is AnswerKind.AMBIGUOUS
    assert answer.possibly_sent
    assert answer.code == code
    assert answer.status_code == status


def test_429_retry_after_is_kept(stripe: StripeProvider, router: respx.Router) -> None:
    router.post("/v1/payment_intents").mock(
        return_value=httpx.Response(
            429,
            headers={"Retry-After": "7"},
            json=stripe_error("invalid_request_error", "Too many requests", code="rate_limit"),
        )
    )
    answer = stripe.submit(create_request())
    assert (answer.kind, answer.retry_after, answer.code) == (
        AnswerKind.NOT_SENT,
        7.0,
        "rate_limit",
    )


@pytest.mark.parametrize(
    ("status", "error_type", "code"),
    [
        (400, "invalid_request_error", "parameter_invalid_integer"),
        (404, "invalid_request_error", "resource_missing"),
    ],
)
def test_refusals_are_declined_with_their_code(
    stripe: StripeProvider, router: respx.Router, status: int, error_type: str, code: str | None
) -> None:
    body = stripe_error(error_type, "refused", code=code)
    router.post("/v1/payment_intents").mock(return_value=httpx.Response(status, json=body))
    answer = stripe.submit(create_request())
    assert answer.kind is AnswerKind.DECLINED
    assert answer.code == (code or error_type)
    assert answer.status_code == status


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_5xx_is_ambiguous_with_evidence(
    stripe: StripeProvider, router: respx.Router, status: int
) -> None:
    body = stripe_error("api_error", "An unknown error occurred")
    router.post("/v1/payment_intents").mock(return_value=httpx.Response(status, json=body))
    answer = stripe.submit(create_request())
    assert answer.kind is AnswerKind.AMBIGUOUS
    assert answer.possibly_sent
    assert (answer.status_code, answer.code, answer.body) == (status, f"http_{status}", body)


def test_api_error_on_a_4xx_is_ambiguous(stripe: StripeProvider, router: respx.Router) -> None:
    body = stripe_error("api_error", "A dependency external to Stripe failed")
    router.post("/v1/payment_intents").mock(return_value=httpx.Response(424, json=body))
    answer = stripe.submit(create_request())
    assert (answer.kind, answer.code, answer.status_code) == (
        AnswerKind.AMBIGUOUS,
        "api_error",
        424,
    )


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (401, stripe_error("authentication_error", "refused")),
        (403, stripe_error("permission_error", "refused")),
        (403, None),  # a proxy's page: our credentials or our egress are refused
    ],
)
def test_auth_refusals_are_configuration_faults_not_declines(
    stripe: StripeProvider, router: respx.Router, status: int, body: dict[str, Any] | None
) -> None:
    reply = (
        httpx.Response(status, json=body)
        if body is not None
        else httpx.Response(status, text="<html>blocked by proxy</html>")
    )
    router.post("/v1/payment_intents").mock(return_value=reply)
    answer = stripe.submit(create_request())
    assert (answer.kind, answer.code) == (AnswerKind.NOT_SENT, "provider_auth_failed")
    assert answer.status_code == status


def test_4xx_without_stripe_error_object_is_ambiguous(
    stripe: StripeProvider, router: respx.Router
) -> None:
    router.post("/v1/payment_intents").mock(
        return_value=httpx.Response(418, text="<html>a proxy's page</html>")
    )
    answer = stripe.submit(create_request())
    assert (answer.kind, answer.code) == (AnswerKind.AMBIGUOUS, "http_418")
    assert answer.raw == "<html>a proxy's page</html>"


@pytest.mark.parametrize(
    "reply",
    [
        httpx.Response(200, text="<html>gateway page</html>"),
        httpx.Response(200, json={"object": "payment_intent", "status": "succeeded"}),
        httpx.Response(200, json={"id": PI_ID, "object": "payment_intent"}),
        httpx.Response(200, json={"id": RE_ID, "object": "refund", "status": "succeeded"}),
        httpx.Response(200, json=[payment_intent()]),
    ],
)
def test_unusable_2xx_body_is_ambiguous(
    stripe: StripeProvider, router: respx.Router, reply: httpx.Response
) -> None:
    router.post("/v1/payment_intents").mock(return_value=reply)
    answer = stripe.submit(create_request())
    assert answer.kind is AnswerKind.AMBIGUOUS
    assert answer.status_code == 200
    assert answer.code == "unexpected_body"
    assert answer.body is not None or answer.raw is not None


def test_non_json_2xx_keeps_bounded_raw(stripe: StripeProvider, router: respx.Router) -> None:
    router.post("/v1/payment_intents").mock(return_value=httpx.Response(200, text="x" * 10_000))
    answer = stripe.submit(create_request())
    assert answer.kind is AnswerKind.AMBIGUOUS
    assert answer.raw == "x" * 4096


def test_replayed_answer_is_marked(stripe: StripeProvider, router: respx.Router) -> None:
    router.post("/v1/payment_intents").mock(
        return_value=httpx.Response(
            200, json=payment_intent(), headers={"Idempotent-Replayed": "true"}
        )
    )
    answer = stripe.submit(create_request())
    assert answer.kind is AnswerKind.SUCCEEDED
    assert answer.message is not None and "Idempotent-Replayed" in answer.message


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (httpx.ConnectError("connection refused"), AnswerKind.NOT_SENT),
        (httpx.ConnectTimeout("connect timed out"), AnswerKind.NOT_SENT),
        (httpx.PoolTimeout("pool exhausted"), AnswerKind.NOT_SENT),
        (httpx.ReadTimeout("read timed out"), AnswerKind.AMBIGUOUS),
        (httpx.WriteTimeout("write timed out"), AnswerKind.AMBIGUOUS),
        (httpx.RemoteProtocolError("peer closed connection"), AnswerKind.AMBIGUOUS),
    ],
)
def test_transport_errors(
    stripe: StripeProvider, router: respx.Router, error: Exception, kind: AnswerKind
) -> None:
    router.post("/v1/payment_intents").mock(side_effect=error)
    answer = stripe.submit(create_request())
    assert answer.kind is kind
    assert answer.code == type(error).__name__


# -- status queries ----------------------------------------------------------------------------


def test_query_by_payment_intent_reference(stripe: StripeProvider, router: respx.Router) -> None:
    route = router.get(f"/v1/payment_intents/{PI_ID}").mock(
        return_value=httpx.Response(200, json=payment_intent("processing"))
    )
    answer = stripe.query_status(query())
    assert (answer.kind, answer.provider_reference, answer.status_code) == (
        AnswerKind.PENDING,
        PI_ID,
        200,
    )
    assert route.calls.last.request.headers["authorization"] == f"Bearer {API_KEY}"
    assert "idempotency-key" not in route.calls.last.request.headers


def test_query_by_refund_reference(stripe: StripeProvider, router: respx.Router) -> None:
    router.get(f"/v1/refunds/{RE_ID}").mock(return_value=httpx.Response(200, json=refund("failed")))
    answer = stripe.query_status(query("refund.create", RE_ID))
    assert (answer.kind, answer.provider_reference) == (AnswerKind.DECLINED, RE_ID)


def test_query_resource_missing_is_not_found(stripe: StripeProvider, router: respx.Router) -> None:
    body = stripe_error(
        "invalid_request_error",
        f"No such payment_intent: '{PI_ID}'",
        code="resource_missing",
        param="intent",
    )
    router.get(f"/v1/payment_intents/{PI_ID}").mock(return_value=httpx.Response(404, json=body))
    answer = stripe.query_status(query())
    assert (answer.kind, answer.code, answer.status_code) == (
        AnswerKind.NOT_FOUND,
        "resource_missing",
        404,
    )


def test_query_refusal_is_never_declined(stripe: StripeProvider, router: respx.Router) -> None:
    body = stripe_error("invalid_request_error", "Invalid API Key provided: sk_test_****dc")
    router.get(f"/v1/payment_intents/{PI_ID}").mock(return_value=httpx.Response(401, json=body))
    answer = stripe.query_status(query())
    # A read refused for our credentials is no evidence either way: look again later.
    assert answer.kind is AnswerKind.NOT_SENT
    assert answer.code == "provider_auth_failed"
    assert answer.status_code == 401


@pytest.mark.parametrize(
    ("reply", "kind"),
    [
        (httpx.ConnectError("refused"), AnswerKind.NOT_SENT),
        (httpx.ReadTimeout("slow"), AnswerKind.AMBIGUOUS),
        (httpx.Response(503, json=stripe_error("api_error", "down")), AnswerKind.AMBIGUOUS),
        (
            httpx.Response(429, json=stripe_error("rate_limit_error", "slow down")),
            AnswerKind.NOT_SENT,
        ),
    ],
)
def test_query_unavailable_comes_back_as_is(
    stripe: StripeProvider, router: respx.Router, reply: Any, kind: AnswerKind
) -> None:
    router.get(f"/v1/payment_intents/{PI_ID}").mock(side_effect=[reply])
    assert stripe.query_status(query()).kind is kind


def test_query_reference_of_another_operation_is_ambiguous(
    stripe: StripeProvider, router: respx.Router
) -> None:
    router.get(f"/v1/payment_intents/{PI_ID}").mock(
        return_value=httpx.Response(200, json=payment_intent(operation_id="another-op"))
    )
    answer = stripe.query_status(query())
    assert (answer.kind, answer.code) == (AnswerKind.AMBIGUOUS, "reference_mismatch")


def test_query_invalid_reference_sends_nothing(
    stripe: StripeProvider, router: respx.Router
) -> None:
    catch_all = router.route().mock(return_value=httpx.Response(200, json=payment_intent()))
    answer = stripe.query_status(query(reference="pi_1/../../v1/x"))
    assert (answer.kind, answer.code) == (AnswerKind.AMBIGUOUS, "invalid_reference")
    assert not catch_all.called


def search_result(*intents: dict[str, Any]) -> dict[str, Any]:
    return {
        "object": "search_result",
        "url": "/v1/payment_intents/search",
        "has_more": False,
        "data": list(intents),
        "next_page": None,
    }


def test_search_fallback_finds_and_rereads_the_intent(
    stripe: StripeProvider, router: respx.Router
) -> None:
    search = router.get("/v1/payment_intents/search").mock(
        return_value=httpx.Response(200, json=search_result(payment_intent("processing")))
    )
    fresh = router.get(f"/v1/payment_intents/{PI_ID}").mock(
        return_value=httpx.Response(200, json=payment_intent("succeeded"))
    )
    answer = stripe.query_status(query(reference=None))
    assert search.calls.last.request.url.params["query"] == (
        f"metadata['payorch_operation_id']:'{OP_ID}'"
    )
    assert fresh.called
    # The fresh read decides, not the (possibly stale) search index.
    assert (answer.kind, answer.provider_reference) == (AnswerKind.SUCCEEDED, PI_ID)


def test_search_of_a_namespace_keyed_operation_asks_by_its_ref(
    stripe: StripeProvider, router: respx.Router
) -> None:
    tagged = payment_intent("succeeded")
    tagged["metadata"] = {"payorch_ref": NS_REF, "payorch_tenant_id": TENANT}
    search = router.get("/v1/payment_intents/search").mock(
        return_value=httpx.Response(200, json=search_result(tagged))
    )
    router.get(f"/v1/payment_intents/{PI_ID}").mock(return_value=httpx.Response(200, json=tagged))
    answer = stripe.query_status(
        StatusQuery(
            tenant_id=TENANT,
            operation="payment.create",
            operation_id=OP_ID,
            downstream_key=NS_KEY,
            provider_reference=None,
            idempotency_key="order-17",
        )
    )
    assert search.calls.last.request.url.params["query"] == f"metadata['payorch_ref']:'{NS_REF}'"
    assert (answer.kind, answer.provider_reference) == (AnswerKind.SUCCEEDED, PI_ID)


def test_search_fallback_empty_is_not_found(stripe: StripeProvider, router: respx.Router) -> None:
    router.get("/v1/payment_intents/search").mock(
        return_value=httpx.Response(200, json=search_result())
    )
    answer = stripe.query_status(query(reference=None))
    assert (answer.kind, answer.status_code) == (AnswerKind.NOT_FOUND, 200)


def test_search_with_duplicates_reports_money_that_moved(
    stripe: StripeProvider, router: respx.Router
) -> None:
    other = "pi_3MtwBwLkdIwHu7ix0000dupe"
    router.get("/v1/payment_intents/search").mock(
        return_value=httpx.Response(
            200, json=search_result(payment_intent("canceled"), payment_intent(ident=other))
        )
    )
    router.get(f"/v1/payment_intents/{PI_ID}").mock(
        return_value=httpx.Response(200, json=payment_intent("canceled"))
    )
    router.get(f"/v1/payment_intents/{other}").mock(
        return_value=httpx.Response(200, json=payment_intent("succeeded", ident=other))
    )
    answer = stripe.query_status(query(reference=None))
    assert (answer.kind, answer.provider_reference) == (AnswerKind.SUCCEEDED, other)
    assert answer.message is not None and "2 Stripe objects" in answer.message


def test_search_escapes_quotes(stripe: StripeProvider, router: respx.Router) -> None:
    search = router.get("/v1/payment_intents/search").mock(
        return_value=httpx.Response(200, json=search_result())
    )
    odd = StatusQuery(
        tenant_id=TENANT,
        operation="payment.create",
        operation_id="x' OR created>0 OR status:'succeeded",
        downstream_key=KEY,
        provider_reference=None,
    )
    stripe.query_status(odd)
    assert search.calls.last.request.url.params["query"] == (
        "metadata['payorch_operation_id']:'x\\' OR created>0 OR status:\\'succeeded'"
    )


def test_refund_fallback_lists_and_matches_metadata(
    stripe: StripeProvider, router: respx.Router
) -> None:
    page_one = {
        "object": "list",
        "url": "/v1/refunds",
        "has_more": True,
        "data": [refund(ident="re_other1", operation_id="other-op")],
    }
    page_two = {
        "object": "list",
        "url": "/v1/refunds",
        "has_more": False,
        "data": [refund("pending")],
    }
    route = router.get("/v1/refunds").mock(
        side_effect=[httpx.Response(200, json=page_one), httpx.Response(200, json=page_two)]
    )
    answer = stripe.query_status(query("refund.create", None, payment_intent=PI_ID))
    first, second = (call.request.url.params for call in route.calls)
    assert (first["payment_intent"], first["limit"]) == (PI_ID, "100")
    assert "starting_after" not in first
    assert second["starting_after"] == "re_other1"
    assert (answer.kind, answer.provider_reference) == (AnswerKind.PENDING, RE_ID)


def test_refund_fallback_without_match_is_not_found(
    stripe: StripeProvider, router: respx.Router
) -> None:
    router.get("/v1/refunds").mock(
        return_value=httpx.Response(
            200,
            json={"object": "list", "url": "/v1/refunds", "has_more": False, "data": []},
        )
    )
    answer = stripe.query_status(query("refund.create", None, payment_intent=PI_ID))
    assert answer.kind is AnswerKind.NOT_FOUND


def test_refund_fallback_needs_the_payment_intent(
    stripe: StripeProvider, router: respx.Router
) -> None:
    catch_all = router.route().mock(return_value=httpx.Response(200, json={}))
    with pytest.raises(ConfigurationError, match="payment_intent"):
        stripe.query_status(query("refund.create", None))
    assert not catch_all.called


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        ("succeeded", AnswerKind.SUCCEEDED),
        ("processing", AnswerKind.PENDING),
        ("requires_capture", AnswerKind.NOT_FOUND),  # the capture has not happened
        ("canceled", AnswerKind.DECLINED),
    ],
)
def test_capture_query_reads_the_intent(
    stripe: StripeProvider, router: respx.Router, status: str, kind: AnswerKind
) -> None:
    router.get(f"/v1/payment_intents/{PI_ID}").mock(
        return_value=httpx.Response(200, json=payment_intent(status, capture_method="manual"))
    )
    answer = stripe.query_status(query("payment.capture", None, payment_intent=PI_ID))
    assert (answer.kind, answer.provider_reference) == (kind, PI_ID)


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
