"""A re-send is the wire request the claim kept, or nothing: never a request built for another
key, never to another endpoint, never by an adapter that cannot send it as it is.

Effects are counted at the sandbox's ledger, the Stripe-shaped and the Adyen-shaped
emulators."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import FAST_TIMEOUT, age, make_due

from payorch.core import State
from payorch.errors import ProviderUnavailable
from payorch.execution._executor import Executor, RetryPolicy
from payorch.operations import default_registry
from payorch.provider import Answer, AnswerKind, SubmitRequest, WireRequest
from payorch.providers.adyen.emulator import AdyenEmulator
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.providers.stripe.emulator import StripeEmulator
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.storage._store import Store
from payorch.storage._tables import operations
from payorch.testing import Fault

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}


def sandbox_executor(store: Store, provider: SandboxProvider) -> Executor:
    return Executor(
        store=store,
        providers=[provider],
        registry=default_registry("sandbox"),
        retry=RetryPolicy(max_attempts=1),
    )


def reconcile(store: Store, provider: Any, **policy: Any) -> Counter[str]:
    rec = Reconciler(
        store=store,
        providers=[provider],
        policy=ReconcilerPolicy(lease=timedelta(minutes=5), **policy),
        owner="test-reconciler",
    )
    return rec.reconcile_once().outcomes


def test_a_take_over_under_an_earlier_key_is_never_re_sent_under_another(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    """A released operation claimed under the earlier, id-derived key form is taken over and
    sent under that key; the request built for today's key is not what went, so a re-send
    would be a second charge under a key the provider never saw: it escalates."""
    executor = sandbox_executor(store, sandbox_provider)
    sandbox.inject("rate_limit")  # certainly not sent: released, nothing stored as final
    with pytest.raises(ProviderUnavailable):
        executor.execute(
            tenant_id="shop",
            operation="payment.create",
            idempotency_key="legacy-1",
            request=PAYMENT,
        )
    op_id = store.get_by_namespace("shop", "payment.create", "legacy-1").id
    legacy = f"payorch:{op_id}:submit"
    with store.engine.begin() as conn:
        conn.execute(
            sa.update(operations).where(operations.c.id == op_id).values(downstream_key=legacy)
        )
    sandbox.inject("error_500_after")  # the take-over's send commits, its answer is a 500
    taken = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key="legacy-1", request=PAYMENT
    )
    assert taken.state is State.OUTCOME_UNKNOWN
    assert len(sandbox.effects_for(legacy)) == 1  # sent under the key the row holds
    make_due(store, op_id)
    age(store, op_id, timedelta(minutes=5))
    report = reconcile(store, sandbox_provider, not_found_grace=timedelta(0))
    # The status query finds it under the key it was sent with.
    assert report == Counter({"succeeded": 1})
    assert len(sandbox.ledger()) == 1


def test_a_re_send_under_a_key_the_wire_does_not_carry_escalates(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    executor = sandbox_executor(store, sandbox_provider)
    sandbox.inject("error_500_before")  # nothing committed, the answer a 500: unknown
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key="k-moved", request=PAYMENT
    )
    assert outcome.state is State.OUTCOME_UNKNOWN
    with store.engine.begin() as conn:  # the row's key is not the one its wire was built for
        conn.execute(
            sa.update(operations)
            .where(operations.c.id == outcome.operation_id)
            .values(downstream_key=f"payorch:{outcome.operation_id}:submit")
        )
    make_due(store, outcome.operation_id)
    age(store, outcome.operation_id, timedelta(minutes=5))
    assert reconcile(store, sandbox_provider, not_found_grace=timedelta(0)) == Counter(
        {"escalated": 1}
    )
    record = store.get("shop", outcome.operation_id)
    assert record.state is State.OUTCOME_UNKNOWN and record.needs_attention
    assert sandbox.ledger() == []  # nothing re-sent


def test_a_re_send_to_another_endpoint_sends_nothing(
    store: Store, adyen_emulator: AdyenEmulator
) -> None:
    """The same bytes to another API version (or region, or endpoint) are another request."""
    adyen_emulator.inject(Fault.DROP_AFTER_COMMIT)
    with adyen_emulator.adapter() as adyen:
        outcome = Executor(
            store=store, providers=[adyen], retry=RetryPolicy(max_attempts=1)
        ).execute(
            tenant_id="shop",
            operation="payment.create",
            idempotency_key="moved-1",
            request=adyen_emulator.payload("payment.create", capture_method="automatic"),
            provider="adyen",
        )
    assert outcome.state is State.OUTCOME_UNKNOWN
    age(store, outcome.operation_id, timedelta(minutes=10))
    make_due(store, outcome.operation_id)
    sent = len(adyen_emulator.received)
    other = adyen_emulator.url.replace("/v71", "/v70")
    with adyen_emulator.adapter(base_url=other) as elsewhere:
        reconcile(store, elsewhere)
    record = store.get("shop", outcome.operation_id)
    assert record.state is State.OUTCOME_UNKNOWN and record.needs_attention
    assert len(adyen_emulator.received) == sent  # nothing went anywhere


class _Wrapped:
    """A custom adapter around the sandbox's, without ``wire_request``: it cannot say what
    it would send, so nothing it would build again is ever re-sent."""

    def __init__(self, inner: SandboxProvider) -> None:
        self._inner = inner
        self.name = inner.name
        self.idempotency_window = inner.idempotency_window
        self.max_call_duration = inner.max_call_duration
        self.capabilities = inner.capabilities

    def submit(self, request: SubmitRequest) -> Answer:
        return self._inner.submit(replace(request, wire=None))

    def query_status(self, query: Any) -> Answer:
        return self._inner.query_status(query)

    def parse_webhook(self, headers: Any, body: bytes) -> Any:
        return self._inner.parse_webhook(headers, body)


def test_an_adapter_that_cannot_send_the_kept_request_never_re_sends(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    executor = sandbox_executor(store, sandbox_provider)
    sandbox.inject("error_500_before")
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key="wrap-1", request=PAYMENT
    )
    assert outcome.state is State.OUTCOME_UNKNOWN
    make_due(store, outcome.operation_id)
    age(store, outcome.operation_id, timedelta(minutes=5))
    wrapped = _Wrapped(SandboxProvider(base_url=sandbox.url, timeout=FAST_TIMEOUT))
    try:
        report = reconcile(store, wrapped, not_found_grace=timedelta(0))
    finally:
        wrapped._inner.close()
    assert report == Counter({"escalated": 1})
    assert store.get("shop", outcome.operation_id).needs_attention
    assert sandbox.ledger() == []
    # The app's own (a Resender) re-sends the request it kept: one effect.
    make_due(store, outcome.operation_id)
    assert reconcile(store, sandbox_provider, not_found_grace=timedelta(0)) == Counter(
        {"resubmitted_succeeded": 1}
    )
    assert len(sandbox.ledger()) == 1


def test_stripe_sends_the_kept_request_as_it_is(stripe_emulator: StripeEmulator) -> None:
    """Sent as kept, under another API version configured here: Stripe's own idempotency
    answers the first intent, one effect."""
    with (
        stripe_emulator.adapter() as first,
        stripe_emulator.adapter(stripe_version="2099-01-01") as later,
    ):
        request = SubmitRequest(
            tenant_id="shop",
            operation="payment.create",
            operation_id="",
            downstream_key="payorch:0123456789abcdef0123456789abcdef:submit",
            payload=stripe_emulator.payload("payment.create"),
            idempotency_key="k1",
        )
        wire = first.wire_request(request)
        assert isinstance(wire, WireRequest)
        answered = first.submit(replace(request, wire=wire))
        again = later.submit(replace(request, wire=wire))
    assert answered.kind is AnswerKind.SUCCEEDED
    assert again.kind is AnswerKind.SUCCEEDED
    assert again.provider_reference == answered.provider_reference
    assert stripe_emulator.effects(request.downstream_key) == 1
    (sent_first, sent_again) = [
        r for r in stripe_emulator.requests() if r["idempotency_key"] == request.downstream_key
    ]
    assert sent_again["fields"] == sent_first["fields"]
