"""The Stripe adapter's status queries: by reference, and by search or listing without one."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import respx
from stripe_helpers import (
    API_KEY,
    KEY,
    NS_KEY,
    NS_REF,
    OP_ID,
    PI_ID,
    RE_ID,
    TENANT,
    payment_intent,
    query,
    refund,
    search_result,
    stripe_error,
)

from payorch.errors import ConfigurationError
from payorch.provider import AnswerKind, StatusQuery
from payorch.providers.stripe import StripeProvider

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
