"""The Stripe adapter's void: its capabilities, and each answer of a cancel of an uncaptured
PaymentIntent (found by reference, else by Search), sync and async alike."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
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
    TENANT,
    payment_intent,
    search_result,
    stripe_error,
)

from payorch.core import downstream_key
from payorch.provider import (
    Answer,
    AnswerKind,
    AsyncVoider,
    Capability,
    Voider,
    VoidRequest,
    can_void,
    capabilities_of,
)
from payorch.providers.stripe import StripeProvider

CANCEL = f"/v1/payment_intents/{PI_ID}/cancel"
RETRIEVE = f"/v1/payment_intents/{PI_ID}"
SEARCH = "/v1/payment_intents/search"


@pytest.fixture
def stripe(router: respx.Router) -> Iterator[StripeProvider]:
    transport = httpx.MockTransport(router.handler)
    with StripeProvider(
        api_key=API_KEY, base_url=BASE, transport=transport, async_transport=transport
    ) as provider:
        yield provider


def void_request(
    reference: str | None = PI_ID, *, operation: str = "payment.create", key: str = KEY
) -> VoidRequest:
    return VoidRequest(
        tenant_id=TENANT,
        operation=operation,
        operation_id=OP_ID,
        downstream_key=key,
        provider_reference=reference,
        idempotency_key="order-17" if key == NS_KEY else "",
        reason="deadline passed",
        actor="reconciler",
    )


def both(stripe: StripeProvider, request: VoidRequest) -> list[Answer]:
    """The sync and the async void of ``request``: one flow, the same answer."""

    async def run() -> Answer:
        try:
            return await stripe.avoid(request)
        finally:
            await stripe.aclose()

    return [stripe.void(request), asyncio.run(run())]


def canceled(**fields: Any) -> dict[str, Any]:
    intent = payment_intent("canceled", capture_method="manual")
    return intent | {"cancellation_reason": "abandoned", "canceled_at": 1680800600} | fields


def unexpected_state(status: str) -> dict[str, Any]:
    return stripe_error(
        "invalid_request_error",
        f"You cannot cancel this PaymentIntent because it has a status of {status}.",
        code="payment_intent_unexpected_state",
        payment_intent=payment_intent(status),
    )


def form_of(request: httpx.Request) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(request.content.decode(), strict_parsing=True).items()}


# -- what the adapter declares -----------------------------------------------------------------


def test_declares_status_replay_void_and_webhooks(stripe: StripeProvider) -> None:
    assert capabilities_of(stripe) == {
        Capability.STATUS_BY_REFERENCE,
        Capability.STATUS_BY_KEY,
        Capability.REPLAY,
        Capability.VOID_BY_KEY,
        Capability.VOID_BY_REFERENCE,
        Capability.WEBHOOKS,
    }
    assert stripe.idempotency_window == timedelta(hours=24)
    assert isinstance(stripe, Voider)
    assert isinstance(stripe, AsyncVoider)
    assert can_void(stripe, None)
    assert can_void(stripe, PI_ID)


def test_an_endpoint_without_an_idempotency_window_cannot_replay() -> None:
    with StripeProvider(api_key=API_KEY, base_url=BASE, idempotency_window=None) as stripe:
        caps = capabilities_of(stripe)
    assert Capability.REPLAY not in caps
    assert Capability.VOID_BY_KEY in caps


# -- the answers -------------------------------------------------------------------------------


def test_an_authorised_intent_is_canceled_under_the_void_key(
    stripe: StripeProvider, router: respx.Router
) -> None:
    router.get(RETRIEVE).mock(
        return_value=httpx.Response(200, json=payment_intent("requires_capture"))
    )
    cancel = router.post(CANCEL).mock(return_value=httpx.Response(200, json=canceled()))
    request = void_request()
    for answer in both(stripe, request):
        assert (answer.kind, answer.provider_reference, answer.status_code) == (
            AnswerKind.SUCCEEDED,
            PI_ID,
            200,
        )
    assert cancel.call_count == 2
    for call in cancel.calls:
        sent = call.request
        assert sent.headers["idempotency-key"] == request.void_key == f"{KEY}:void"
        assert sent.headers["authorization"] == f"Bearer {API_KEY}"
        assert form_of(sent) == {"cancellation_reason": "abandoned"}


def test_without_a_reference_the_intent_is_searched_by_its_ref_then_canceled(
    stripe: StripeProvider, router: respx.Router
) -> None:
    intent = payment_intent("requires_capture") | {"metadata": {"payorch_ref": NS_REF}}
    search = router.get(SEARCH).mock(return_value=httpx.Response(200, json=search_result(intent)))
    router.get(RETRIEVE).mock(return_value=httpx.Response(200, json=intent))
    cancel = router.post(CANCEL).mock(return_value=httpx.Response(200, json=canceled()))
    request = void_request(None, key=NS_KEY)
    for answer in both(stripe, request):
        assert (answer.kind, answer.provider_reference) == (AnswerKind.SUCCEEDED, PI_ID)
    assert search.calls.last.request.url.params["query"] == f"metadata['payorch_ref']:'{NS_REF}'"
    assert request.void_key == downstream_key(NS_REF, "void")
    assert cancel.calls.last.request.headers["idempotency-key"] == request.void_key
    # Search, read it fresh, cancel: in this order, on each path.
    order = [(c.request.method, c.request.url.path) for c in router.calls]
    assert order == [("GET", SEARCH), ("GET", RETRIEVE), ("POST", CANCEL)] * 2


def test_nothing_found_is_not_found_and_cancels_nothing(
    stripe: StripeProvider, router: respx.Router
) -> None:
    router.get(SEARCH).mock(return_value=httpx.Response(200, json=search_result()))
    cancel = router.post(url__regex=r"/cancel$")
    for answer in both(stripe, void_request(None, key=NS_KEY)):
        assert answer.kind is AnswerKind.NOT_FOUND
    assert cancel.call_count == 0


def test_a_missing_reference_is_not_found(stripe: StripeProvider, router: respx.Router) -> None:
    body = stripe_error(
        "invalid_request_error", f"No such payment_intent: '{PI_ID}'", code="resource_missing"
    )
    router.get(RETRIEVE).mock(return_value=httpx.Response(404, json=body))
    cancel = router.post(CANCEL)
    for answer in both(stripe, void_request()):
        assert answer.kind is AnswerKind.NOT_FOUND
    assert cancel.call_count == 0


def test_a_captured_intent_is_declined_without_a_cancel(
    stripe: StripeProvider, router: respx.Router
) -> None:
    router.get(RETRIEVE).mock(return_value=httpx.Response(200, json=payment_intent("succeeded")))
    cancel = router.post(CANCEL)
    for answer in both(stripe, void_request()):
        assert (answer.kind, answer.code, answer.provider_reference) == (
            AnswerKind.DECLINED,
            "already_captured",
            PI_ID,
        )
        assert "succeeded" in (answer.message or "")
    assert cancel.call_count == 0


def test_an_intent_canceled_already_is_void(stripe: StripeProvider, router: respx.Router) -> None:
    router.get(RETRIEVE).mock(return_value=httpx.Response(200, json=canceled()))
    cancel = router.post(CANCEL)
    for answer in both(stripe, void_request()):
        assert (answer.kind, answer.provider_reference) == (AnswerKind.SUCCEEDED, PI_ID)
    assert cancel.call_count == 0


@pytest.mark.parametrize(
    ("status", "kind", "code"),
    [
        ("succeeded", AnswerKind.DECLINED, "already_captured"),  # captured meanwhile
        ("canceled", AnswerKind.SUCCEEDED, None),  # canceled meanwhile
        ("processing", AnswerKind.DECLINED, "payment_intent_unexpected_state"),
    ],
)
def test_a_refused_cancel_reads_the_intent_stripe_returns(
    stripe: StripeProvider,
    router: respx.Router,
    status: str,
    kind: AnswerKind,
    code: str | None,
) -> None:
    router.get(RETRIEVE).mock(
        return_value=httpx.Response(200, json=payment_intent("requires_capture"))
    )
    router.post(CANCEL).mock(return_value=httpx.Response(400, json=unexpected_state(status)))
    for answer in both(stripe, void_request()):
        assert (answer.kind, answer.code, answer.provider_reference) == (kind, code, PI_ID)
        if kind is AnswerKind.DECLINED:
            assert status in (answer.message or "")


def test_a_declined_intent_is_canceled_too(stripe: StripeProvider, router: respx.Router) -> None:
    # requires_payment_method holds nothing, but could still be confirmed: cancel it.
    router.get(RETRIEVE).mock(
        return_value=httpx.Response(200, json=payment_intent("requires_payment_method"))
    )
    cancel = router.post(CANCEL).mock(return_value=httpx.Response(200, json=canceled()))
    assert stripe.void(void_request()).kind is AnswerKind.SUCCEEDED
    assert cancel.call_count == 1


@pytest.mark.parametrize(
    ("reply", "kind", "code"),
    [
        (
            httpx.Response(429, json=stripe_error("rate_limit_error", "Too many")),
            "not_sent",
            "rate_limited",
        ),
        (httpx.Response(500, json=stripe_error("api_error", "Oops")), "ambiguous", "http_500"),
        (httpx.Response(503, text="upstream"), "ambiguous", "http_503"),
        (
            httpx.Response(
                409,
                json=stripe_error("idempotency_error", "in use", code="idempotency_key_in_use"),
                headers={"Stripe-Should-Retry": "true"},
            ),
            "ambiguous",
            "idempotency_key_in_use",
        ),
    ],
)
def test_a_cancel_that_fails_is_classified_as_any_call(
    stripe: StripeProvider, router: respx.Router, reply: httpx.Response, kind: str, code: str
) -> None:
    router.get(RETRIEVE).mock(
        return_value=httpx.Response(200, json=payment_intent("requires_capture"))
    )
    router.post(CANCEL).mock(return_value=reply)
    for answer in both(stripe, void_request()):
        assert answer.kind is AnswerKind(kind)
        assert answer.code == code


def test_a_cancel_lost_in_transport_is_ambiguous(
    stripe: StripeProvider, router: respx.Router
) -> None:
    router.get(RETRIEVE).mock(
        return_value=httpx.Response(200, json=payment_intent("requires_capture"))
    )
    router.post(CANCEL).mock(side_effect=httpx.ReadTimeout("slow"))
    for answer in both(stripe, void_request()):
        assert (answer.kind, answer.code) == (AnswerKind.AMBIGUOUS, "ReadTimeout")


def test_a_lookup_that_cannot_connect_is_not_sent(
    stripe: StripeProvider, router: respx.Router
) -> None:
    router.get(RETRIEVE).mock(side_effect=httpx.ConnectError("refused"))
    cancel = router.post(CANCEL)
    for answer in both(stripe, void_request()):
        assert answer.kind is AnswerKind.NOT_SENT
    assert cancel.call_count == 0


def test_the_void_key_used_for_another_call_is_ambiguous_not_raised(
    stripe: StripeProvider, router: respx.Router
) -> None:
    router.get(RETRIEVE).mock(
        return_value=httpx.Response(200, json=payment_intent("requires_capture"))
    )
    body = stripe_error("idempotency_error", "Keys for idempotent requests can only be used ...")
    router.post(CANCEL).mock(return_value=httpx.Response(400, json=body))
    for answer in both(stripe, void_request()):
        assert (answer.kind, answer.code) == (AnswerKind.AMBIGUOUS, "idempotency_error")


def test_an_intent_of_another_operation_is_not_canceled(
    stripe: StripeProvider, router: respx.Router
) -> None:
    router.get(RETRIEVE).mock(
        return_value=httpx.Response(
            200, json=payment_intent("requires_capture", operation_id="someone-else")
        )
    )
    cancel = router.post(CANCEL)
    for answer in both(stripe, void_request()):
        assert (answer.kind, answer.code) == (AnswerKind.AMBIGUOUS, "reference_mismatch")
    assert cancel.call_count == 0


@pytest.mark.parametrize("operation", ["payment.capture", "refund.create", "payout.create"])
def test_only_payment_create_is_voidable_and_nothing_is_sent(
    stripe: StripeProvider, router: respx.Router, operation: str
) -> None:
    for answer in both(stripe, void_request(operation=operation)):
        assert (answer.kind, answer.code) == (AnswerKind.DECLINED, "not_voidable")
    assert router.calls.call_count == 0


def test_a_reference_that_is_no_intent_id_sends_nothing(
    stripe: StripeProvider, router: respx.Router
) -> None:
    for reference in ("re_1Nispe2eZvKYlo2Cd31jOCgZ", "pi_../../v1/refunds"):
        answer = stripe.void(void_request(reference))
        assert (answer.kind, answer.code) == (AnswerKind.AMBIGUOUS, "invalid_reference")
    assert router.calls.call_count == 0
