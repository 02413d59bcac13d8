"""execute() through the Stripe adapter (respx): one Idempotency-Key for every attempt."""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import parse_qs

import httpx
import respx
from conftest import RecordingSleep

from payorch.core import State
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.providers.stripe import StripeProvider
from payorch.storage._store import Store

BASE = "https://api.stripe.test"
INTENT = {
    "id": "pi_3MtwBwLkdIwHu7ix28a3tqPa",
    "object": "payment_intent",
    "amount": 2000,
    "currency": "eur",
    "status": "succeeded",
    "metadata": {},
}


def test_rate_limited_then_created_with_one_key_for_every_attempt(store: Store) -> None:
    timeout = httpx.Timeout(connect=1.0, read=2.0, write=1.0, pool=1.0)
    with respx.mock(base_url=BASE, assert_all_called=True) as mock:
        route = mock.post("/v1/payment_intents").mock(
            side_effect=[
                httpx.Response(
                    429,
                    headers={"Retry-After": "1"},
                    json={"error": {"type": "rate_limit_error", "message": "Too many requests"}},
                ),
                httpx.Response(500, json={"error": {"type": "api_error"}}),
            ]
        )
        with StripeProvider(api_key="sk_test_x", base_url=BASE, timeout=timeout) as stripe:
            ex = Executor(
                store=store,
                providers=[stripe],
                registry=default_registry("stripe"),
                lease=timedelta(seconds=60),
                sleep=RecordingSleep(),
            )
            first = ex.execute(
                tenant_id="shop",
                operation="payment.create",
                idempotency_key="order-9",
                request={"amount": 2000, "currency": "EUR", "payment_method": "pm_card_visa"},
            )
            assert first.state is State.OUTCOME_UNKNOWN  # the 500 may follow a commit
            keys = {call.request.headers["Idempotency-Key"] for call in route.calls}
            record = store.get("shop", first.operation_id)
            assert keys == {record.downstream_key}
            assert len(route.calls) == 2
            forms = [parse_qs(call.request.content.decode()) for call in route.calls]
            assert forms[0] == forms[1]  # every attempt is the same request
            ref = record.downstream_key.split(":")[1]
            assert forms[0]["metadata[payorch_ref]"] == [ref]
            assert forms[0]["metadata[payorch_tenant_id]"] == ["shop"]
            assert forms[0]["metadata[payorch_idempotency_key]"] == ["order-9"]
            assert "metadata[payorch_operation_id]" not in forms[0]  # the id never crosses
            assert record.id not in route.calls[0].request.content.decode()

            route.side_effect = [httpx.Response(200, json=INTENT)]
            search = mock.get("/v1/payment_intents/search").mock(
                return_value=httpx.Response(
                    200, json={"object": "search_result", "data": [INTENT], "has_more": False}
                )
            )
            mock.get(f"/v1/payment_intents/{INTENT['id']}").mock(
                return_value=httpx.Response(200, json=INTENT)
            )
            from conftest import make_due

            from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy

            make_due(store, record.id)
            rec = Reconciler(
                store=store, providers=[stripe], policy=ReconcilerPolicy(lease=timedelta(minutes=2))
            )
            assert rec.reconcile_once().outcomes["succeeded"] == 1
            assert store.get("shop", record.id).provider_reference == INTENT["id"]
            assert len(route.calls) == 2  # resolved by a status query, never re-sent
            assert search.calls.last.request.url.params["query"] == (
                f"metadata['payorch_ref']:'{ref}'"
            )
