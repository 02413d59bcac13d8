"""How the Stripe adapter classifies submit replies: statuses, Stripe errors, transport."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import respx
from stripe_helpers import (
    KEY,
    OP_ID,
    PI_ID,
    RE_ID,
    TENANT,
    create_request,
    payment_intent,
    refund,
    stripe_error,
)

from payorch.errors import ProviderIdempotencyError
from payorch.provider import AnswerKind, SubmitRequest
from payorch.providers.stripe import StripeProvider

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
