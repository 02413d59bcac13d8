"""The Stripe adapter against respx-mocked replies shaped like Stripe's documented ones:
its construction and the requests it sends (form, metadata, the same Idempotency-Key).

How it classifies replies is in test_stripe_answers.py, status queries and their fallbacks
in test_stripe_queries.py, webhooks in test_stripe_webhooks.py; the Stripe-shaped bodies
they share in stripe_helpers.py.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
import respx
from stripe_helpers import (
    API_KEY,
    BASE,
    KEY,
    NS_KEY,
    NS_REF,
    OP_ID,
    PI_ID,
    RE_ID,
    TENANT,
    create_request,
    payment_intent,
    query,
    refund,
    stripe_error,
)

from payorch.errors import ConfigurationError
from payorch.provider import AnswerKind, Provider, SubmitRequest
from payorch.providers.stripe import (
    DEFAULT_TIMEOUT,
    IDEMPOTENCY_WINDOW,
    SUPPORTED_OPERATIONS,
    StripeProvider,
)


def form_of(request: httpx.Request) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(request.content.decode(), strict_parsing=True).items()}


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
