"""A status lookup that finds two provider objects for one operation flags it.

The operation settles by the evidence (the object that moved money wins), but a human must
look at the second effect: ``needs_attention`` is set and the event names both references.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import httpx
import respx
from conftest import RecordingSleep, effects_of, make_due

from payorch.core import State
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.provider import AnswerKind, StatusQuery, SubmitRequest
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.providers.stripe import StripeProvider
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.storage._store import Store

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}


def reconciler(store: Store, provider: SandboxProvider | StripeProvider) -> Reconciler:
    return Reconciler(
        store=store,
        providers=[provider],
        policy=ReconcilerPolicy(lease=timedelta(minutes=2)),
        owner="test-reconciler",
    )


def test_sandbox_listing_with_two_effects_settles_and_flags(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    sandbox.inject("drop_after")  # committed, but the answer never arrives
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key="k1", request=PAYMENT
    )
    assert outcome.state is State.OUTCOME_UNKNOWN
    record = store.get("shop", outcome.operation_id)
    assert record.provider_reference is None  # so the check lists by downstream key
    # Past the provider's key window, a stray re-send under the same key makes a second
    # effect (an old worker, a replayed queue message...).
    sandbox.advance(sandbox_provider.idempotency_window or timedelta(0))
    stray = sandbox_provider.submit(
        SubmitRequest(
            tenant_id="shop",
            operation="payment.create",
            operation_id=record.id,
            downstream_key=record.downstream_key,
            payload=PAYMENT,
            idempotency_key=record.idempotency_key,
            fingerprint=record.fingerprint,
        )
    )
    assert stray.kind is AnswerKind.SUCCEEDED
    refs = {e["id"] for e in effects_of(sandbox, store, "shop", record.id)}
    assert len(refs) == 2

    make_due(store, record.id)
    report = reconciler(store, sandbox_provider).reconcile_once()
    assert report.outcomes == Counter({"succeeded": 1})
    settled = store.get("shop", record.id)
    assert settled.state is State.SUCCEEDED and settled.resolution == "status_query"
    assert settled.needs_attention  # settled by evidence, yet a human must look
    assert settled.provider_reference in refs
    last = store.events("shop", record.id)[-1]
    assert last.kind == "status_query" and last.to_state == "succeeded"
    assert last.detail is not None and set(last.detail["duplicate"]) == refs
    assert len(sandbox.ledger()) == 2  # the reconciler added nothing


def test_sandbox_adapter_names_the_other_effect(
    sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    request = SubmitRequest(
        tenant_id="shop",
        operation="payment.create",
        operation_id="op_1",
        downstream_key="payorch:op_1:submit",
        payload=PAYMENT,
    )
    first = sandbox_provider.submit(request)
    sandbox.advance(sandbox_provider.idempotency_window or timedelta(0))
    second = sandbox_provider.submit(request)
    answer = sandbox_provider.query_status(
        StatusQuery(
            tenant_id="shop",
            operation="payment.create",
            operation_id="op_1",
            downstream_key=request.downstream_key,
            provider_reference=None,
        )
    )
    refs = {first.provider_reference, second.provider_reference}
    assert answer.provider_reference in refs
    assert set(answer.duplicates) == refs - {answer.provider_reference}
    assert answer.evidence()["duplicates"] == list(answer.duplicates)


BASE = "https://api.stripe.test"
PI_A = "pi_3MtwBwLkdIwHu7ix28a3tqPa"
PI_B = "pi_3MtwBwLkdIwHu7ix0000dupe"


def intent(ident: str, status: str) -> dict[str, object]:
    return {
        "id": ident,
        "object": "payment_intent",
        "amount": 1250,
        "currency": "eur",
        "status": status,
        "metadata": {},
    }


def test_stripe_search_with_two_intents_settles_by_money_and_flags(store: Store) -> None:
    timeout = httpx.Timeout(connect=1.0, read=2.0, write=1.0, pool=1.0)
    with (
        respx.mock(base_url=BASE, assert_all_called=True) as mock,
        StripeProvider(api_key="sk_test_x", base_url=BASE, timeout=timeout) as stripe,
    ):
        mock.post("/v1/payment_intents").mock(
            return_value=httpx.Response(500, json={"error": {"type": "api_error"}})
        )
        ex = Executor(
            store=store,
            providers=[stripe],
            registry=default_registry("stripe"),
            lease=timedelta(seconds=60),
            sleep=RecordingSleep(),
        )
        outcome = ex.execute(
            tenant_id="shop",
            operation="payment.create",
            idempotency_key="order-9",
            request={"amount": 1250, "currency": "EUR", "payment_method": "pm_card_visa"},
        )
        assert outcome.state is State.OUTCOME_UNKNOWN
        mock.get("/v1/payment_intents/search").mock(
            return_value=httpx.Response(
                200,
                json={
                    "object": "search_result",
                    "data": [intent(PI_A, "canceled"), intent(PI_B, "succeeded")],
                    "has_more": False,
                },
            )
        )
        mock.get(f"/v1/payment_intents/{PI_A}").mock(
            return_value=httpx.Response(200, json=intent(PI_A, "canceled"))
        )
        mock.get(f"/v1/payment_intents/{PI_B}").mock(
            return_value=httpx.Response(200, json=intent(PI_B, "succeeded"))
        )
        make_due(store, outcome.operation_id)
        assert reconciler(store, stripe).reconcile_once().outcomes == Counter({"succeeded": 1})
    record = store.get("shop", outcome.operation_id)
    assert record.state is State.SUCCEEDED and record.provider_reference == PI_B
    assert record.needs_attention
    last = store.events("shop", record.id)[-1]
    assert last.kind == "status_query"
    assert last.detail is not None and last.detail["duplicate"] == [PI_B, PI_A]


def test_a_single_object_settles_without_a_flag(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    sandbox.inject("drop_after")
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key="k1", request=PAYMENT
    )
    make_due(store, outcome.operation_id)
    assert reconciler(store, sandbox_provider).reconcile_once().outcomes == Counter(
        {"succeeded": 1}
    )
    record = store.get("shop", outcome.operation_id)
    assert record.state is State.SUCCEEDED and not record.needs_attention
    last = store.events("shop", record.id)[-1]
    assert last.detail is not None and "duplicate" not in last.detail
