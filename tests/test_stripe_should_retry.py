"""What ``Stripe-Should-Retry: true`` promises: a retry with the same key is safe.

It does not promise that nothing happened. With 409 ``idempotency_key_in_use`` another
request under our key is still executing and may move money; such a reply is AMBIGUOUS
(the reconciler asks later), so an operation can never end ``failed_final`` "nothing sent"
while its key may have acted. Replies Stripe documents as not executed (lock contention,
rate limits) stay NOT_SENT and are retried inline with the same key.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import pytest
import respx
from conftest import RecordingSleep, make_due

from payorch.core import State
from payorch.execution._executor import Executor
from payorch.http import http_answer
from payorch.operations import default_registry
from payorch.provider import AnswerKind, SubmitRequest
from payorch.providers.stripe import StripeProvider
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.storage._store import Store

BASE = "https://api.stripe.test"
TIMEOUT = httpx.Timeout(connect=1.0, read=2.0, write=1.0, pool=1.0)
IN_USE = {
    "error": {
        "type": "idempotency_error",
        "code": "idempotency_key_in_use",
        "message": "There is currently another in-progress request using this Idempotent Key.",
    }
}
RETRY = {"Stripe-Should-Retry": "true", "Retry-After": "3"}


def intent(ref: str) -> dict[str, Any]:
    """A PaymentIntent payorch made: tagged with its operation's namespace ref."""
    return {
        "id": "pi_3MtwBwLkdIwHu7ix28a3tqPa",
        "object": "payment_intent",
        "amount": 2000,
        "currency": "eur",
        "status": "succeeded",
        "metadata": {"payorch_ref": ref},
    }


def request() -> SubmitRequest:
    op_id = "0192c0de-7a1b-7c3d-8e4f-5a6b7c8d9e0f"
    return SubmitRequest(
        tenant_id="shop",
        operation="payment.create",
        operation_id=op_id,
        downstream_key=f"payorch:{op_id}:1",
        payload={"amount": 2000, "currency": "EUR", "payment_method": "pm_card_visa"},
    )


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (409, IN_USE),
        (400, {"error": {"type": "invalid_request_error", "code": "processing_error"}}),
        (402, {"error": {"type": "card_error", "code": "card_declined"}}),
    ],
)
def test_should_retry_is_not_a_promise_that_nothing_happened(
    status: int, body: dict[str, Any]
) -> None:
    with respx.mock(base_url=BASE) as mock:
        mock.post("/v1/payment_intents").mock(
            return_value=httpx.Response(status, json=body, headers=RETRY)
        )
        with StripeProvider(api_key="sk_test_x", base_url=BASE, timeout=TIMEOUT) as stripe:
            answer = stripe.submit(request())
    assert answer.kind is AnswerKind.AMBIGUOUS
    assert answer.possibly_sent
    assert answer.retry_after == 3.0  # the reconciler looks again no sooner


@pytest.mark.parametrize(
    ("status", "code"), [(429, "lock_timeout"), (400, "lock_timeout"), (400, "rate_limit")]
)
def test_documented_not_executed_replies_stay_not_sent(status: int, code: str) -> None:
    body = {"error": {"type": "invalid_request_error", "code": code}}
    with respx.mock(base_url=BASE) as mock:
        mock.post("/v1/payment_intents").mock(
            return_value=httpx.Response(status, json=body, headers=RETRY)
        )
        with StripeProvider(api_key="sk_test_x", base_url=BASE, timeout=TIMEOUT) as stripe:
            answer = stripe.submit(request())
    assert (answer.kind, answer.code) == (AnswerKind.NOT_SENT, code)


def _executor(store: Store, stripe: StripeProvider) -> Executor:
    return Executor(
        store=store,
        providers=[stripe],
        registry=default_registry("stripe"),
        lease=timedelta(seconds=60),
        sleep=RecordingSleep(),
    )


def _pay(ex: Executor, key: str) -> Any:
    return ex.execute(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key=key,
        request={"amount": 2000, "currency": "EUR", "payment_method": "pm_card_visa"},
    )


def test_key_in_use_ends_unknown_and_the_reconciler_finds_the_charge(store: Store) -> None:
    with respx.mock(base_url=BASE, assert_all_called=True) as mock:
        route = mock.post("/v1/payment_intents").mock(
            return_value=httpx.Response(409, json=IN_USE, headers=RETRY)
        )
        with StripeProvider(api_key="sk_test_x", base_url=BASE, timeout=TIMEOUT) as stripe:
            outcome = _pay(_executor(store, stripe), "in-use")
            record = store.get("shop", outcome.operation_id)
            # Never "failed, nothing sent": the request holding our key may charge.
            assert (record.state, record.possibly_sent) == (State.OUTCOME_UNKNOWN, True)
            answer = http_answer(outcome)
            assert (answer.status, answer.body["retry"]) == (202, "same_key")

            ref = record.downstream_key.split(":")[1]
            found = intent(ref)
            search = mock.get("/v1/payment_intents/search").mock(
                return_value=httpx.Response(
                    200, json={"object": "search_result", "data": [found], "has_more": False}
                )
            )
            mock.get(f"/v1/payment_intents/{found['id']}").mock(
                return_value=httpx.Response(200, json=found)
            )
            make_due(store, record.id)
            rec = Reconciler(
                store=store, providers=[stripe], policy=ReconcilerPolicy(lease=timedelta(minutes=2))
            )
            rec.reconcile_once()
            assert search.calls.last.request.url.params["query"] == (
                f"metadata['payorch_ref']:'{ref}'"
            )
    settled = store.get("shop", record.id)
    assert (settled.state, settled.provider_reference) == (State.SUCCEEDED, found["id"])
    assert len(route.calls) == 1  # settled by a status query, never re-sent


def test_lock_timeouts_are_retried_inline_with_one_key(store: Store) -> None:
    locked = {"error": {"type": "invalid_request_error", "code": "lock_timeout"}}
    with respx.mock(base_url=BASE, assert_all_called=True) as mock:
        route = mock.post("/v1/payment_intents").mock(
            side_effect=[
                httpx.Response(400, json=locked, headers={"Stripe-Should-Retry": "true"}),
                httpx.Response(200, json={**intent("any"), "metadata": {}}),
            ]
        )
        with StripeProvider(api_key="sk_test_x", base_url=BASE, timeout=TIMEOUT) as stripe:
            outcome = _pay(_executor(store, stripe), "locked")
    assert outcome.state is State.SUCCEEDED
    assert len({c.request.headers["Idempotency-Key"] for c in route.calls}) == 1
    assert len(route.calls) == 2
