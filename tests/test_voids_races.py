"""What a void must never do: settle on a provider's "nothing found" that does not block the
key, re-send a payment a void was wanted for, lose its answer to a concurrent write, or void
what is not an authorisation. Effects are counted at the sandbox and the Adyen emulator."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from conftest import age, effects_of, make_due

from payorch.core import State
from payorch.errors import InvalidTransition
from payorch.execution._executor import Executor, RetryPolicy
from payorch.operator import void
from payorch.provider import Answer, AnswerKind, Capability, VoidRequest
from payorch.providers.adyen.emulator import AdyenEmulator
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.reconciling._webhooks import WebhookHandler
from payorch.storage._store import Store
from payorch.testing import Fault

AUTH = {"amount": 900, "currency": "EUR", "customer": "cus_1", "capture_method": "manual"}


class Wrapped:
    """The sandbox adapter with its void (and capabilities) replaced for one test."""

    def __init__(self, inner: SandboxProvider, **overrides: Any) -> None:
        self._inner = inner
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        if name in self._overrides:
            return self._overrides[name]
        return getattr(self._inner, name)


def reconciler(store: Store, provider: Any, **policy: Any) -> Reconciler:
    return Reconciler(
        store=store,
        providers=[provider],
        policy=ReconcilerPolicy(lease=timedelta(seconds=60), **policy),
        owner="test-reconciler",
    )


def unknown(executor: Executor, sandbox: SandboxServer, fault: str, key: str) -> str:
    sandbox.inject(fault)
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key=key, request=AUTH
    )
    assert outcome.state is State.OUTCOME_UNKNOWN
    return outcome.operation_id


def test_nothing_found_by_a_void_that_does_not_block_the_key_is_never_final(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown(executor, sandbox, "error_500_before", "nf-1")  # nothing was made
    found_nothing = Answer(kind=AnswerKind.NOT_FOUND, code="resource_missing")
    adapter = Wrapped(sandbox_provider, void=lambda _r: found_nothing)
    age(store, op_id, timedelta(hours=3))
    make_due(store, op_id)
    rec = reconciler(store, adapter, void_after=timedelta(hours=1))
    assert rec.reconcile_once().outcomes == Counter({"void_nothing_found": 1})
    record = store.get("shop", op_id)
    assert record.state is State.OUTCOME_UNKNOWN and record.resolution == "void_nothing_found"
    # The next check finds nothing either: it never re-sends what a void was wanted for.
    make_due(store, op_id)
    assert rec.reconcile_once().outcomes == Counter({"escalated": 1})
    assert store.get("shop", op_id).needs_attention
    assert effects_of(sandbox, store, "shop", op_id) == []


def test_a_void_in_flight_on_an_adapter_that_cannot_void_never_resends_the_payment(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown(executor, sandbox, "error_500_before", "nv-1")
    answers = iter([Answer(kind=AnswerKind.AMBIGUOUS, code="http_500")])
    flaky = Wrapped(sandbox_provider, void=lambda _r: next(answers))
    void(store, reconciler(store, flaky), "shop", op_id, reason="r", actor="a")
    assert store.get("shop", op_id).resolution == "void_requested"
    # Now configured without voids: the check escalates; nothing is re-sent.
    caps = frozenset({Capability.STATUS_BY_KEY, Capability.STATUS_BY_REFERENCE})
    age(store, op_id, timedelta(hours=1))
    make_due(store, op_id)
    plain = Wrapped(sandbox_provider, capabilities=caps, void=None)
    assert reconciler(store, plain).reconcile_once().outcomes == Counter({"escalated": 1})
    assert store.get("shop", op_id).needs_attention
    assert effects_of(sandbox, store, "shop", op_id) == []


def test_a_void_answer_survives_a_write_made_while_it_was_out(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown(executor, sandbox, "drop_after", "race-1")

    def void_while_flagged(request: VoidRequest) -> Answer:
        # A webhook flags the operation while the void is at the provider.
        current = store.get("shop", op_id)
        store.flag_attention(current, kind="void_race", actor="webhook", detail={})
        return sandbox_provider.void(request)

    adapter = Wrapped(sandbox_provider, void=void_while_flagged)
    result = void(store, reconciler(store, adapter), "shop", op_id, reason="r", actor="a")
    assert result.outcome == "voided"
    record = store.get("shop", op_id)
    assert record.state is State.FAILED_FINAL and record.error_code == "voided"
    assert record.needs_attention  # the flag raised meanwhile stays
    assert [e["status"] for e in effects_of(sandbox, store, "shop", op_id)] == ["voided"]


def test_only_an_authorisation_of_the_voidable_types_is_voided(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    sandbox.inject("drop_after")
    refund = executor.execute(
        tenant_id="shop",
        operation="refund.create",
        idempotency_key="rf-1",
        request={"payment_intent": "sbx_x", "amount": 100, "currency": "EUR"},
    )
    assert refund.state is State.OUTCOME_UNKNOWN
    before = store.get("shop", refund.operation_id)
    rec = reconciler(store, sandbox_provider)
    with pytest.raises(InvalidTransition, match=r"refund\.create"):
        void(store, rec, "shop", refund.operation_id, reason="r", actor="a")
    assert store.get("shop", refund.operation_id).version == before.version


# -- Adyen: what notifications may and may not do ------------------------------------------


def adyen_unknown(store: Store, emulator: AdyenEmulator, key: str, **payload: Any) -> str:
    with emulator.adapter() as adyen:
        emulator.inject(Fault.DROP_AFTER_COMMIT)
        outcome = Executor(
            store=store, providers=[adyen], retry=RetryPolicy(max_attempts=1)
        ).execute(
            tenant_id="shop",
            operation="payment.create",
            idempotency_key=key,
            request=emulator.payload("payment.create", **payload),
            provider="adyen",
        )
    assert outcome.state is State.OUTCOME_UNKNOWN
    return outcome.operation_id


def item_for(emulator: AdyenEmulator, key: str, **fields: Any) -> dict[str, Any]:
    [auth] = [
        i
        for i in emulator.notifications()
        if i["merchantReference"] == key and i["eventCode"] == "AUTHORISATION"
    ]
    return {**auth, **fields}


def test_a_refund_event_under_the_payments_reference_never_settles_the_payment(
    store: Store, adyen_emulator: AdyenEmulator
) -> None:
    op_id = adyen_unknown(store, adyen_emulator, "ad-rf-1", capture_method="automatic")
    key = store.get("shop", op_id).downstream_key
    # A refund made in the Customer Area fails: its item carries the payment's reference.
    failed = item_for(adyen_emulator, key, eventCode="REFUND_FAILED", pspReference="R1")
    with adyen_emulator.adapter() as adyen:
        handler = WebhookHandler(store=store, providers=[adyen])
        delivery = handler.handle_delivery("shop", "adyen", *adyen_emulator.sign([failed]))
    assert [r.status.value for r in delivery.results] == ["recorded"]
    assert store.get("shop", op_id).state is State.OUTCOME_UNKNOWN


def test_a_refused_cancel_escalates_and_is_never_sent_again(
    store: Store, adyen_emulator: AdyenEmulator
) -> None:
    op_id = adyen_unknown(store, adyen_emulator, "ad-cf-1")
    key = store.get("shop", op_id).downstream_key
    age(store, op_id, timedelta(hours=3))
    make_due(store, op_id)
    with adyen_emulator.adapter() as adyen:
        rec = reconciler(store, adyen, void_after=timedelta(hours=1))
        assert rec.reconcile_once().outcomes == Counter({"void_pending": 1})
        refused = item_for(
            adyen_emulator,
            key,
            eventCode="TECHNICAL_CANCEL",
            success="false",
            reason="Payment already captured",
            pspReference="C1",
        )
        handler = WebhookHandler(store=store, providers=[adyen])
        delivery = handler.handle_delivery("shop", "adyen", *adyen_emulator.sign([refused]))
        assert [r.status.value for r in delivery.results] == ["recorded"]
        record = store.get("shop", op_id)
        assert record.state is State.OUTCOME_UNKNOWN and record.needs_attention
        assert record.resolution == "void_refused"
        # The next check neither voids again nor replays the payment.
        sent = len(adyen_emulator.received)
        make_due(store, op_id)
        assert rec.reconcile_once().outcomes == Counter({"escalated": 1})
        assert len(adyen_emulator.received) == sent
    assert adyen_emulator.effects(key) == 1


def test_an_item_that_cannot_be_signed_is_refused_alone(
    store: Store, adyen_emulator: AdyenEmulator
) -> None:
    first = adyen_unknown(store, adyen_emulator, "ad-u-1")
    key = store.get("shop", first).downstream_key
    good = adyen_emulator.sign_item(item_for(adyen_emulator, key))
    bad = {**good, "merchantReference": "\ud800"}
    headers = {"Content-Type": "application/json"}
    body = (
        '{"live": "false", "notificationItems": ['
        f'{{"NotificationRequestItem": {_json(good)}}}, '
        f'{{"NotificationRequestItem": {_json(bad)}}}]}}'
    ).encode()
    with adyen_emulator.adapter() as adyen:
        handler = WebhookHandler(store=store, providers=[adyen])
        delivery = handler.handle_delivery("shop", "adyen", headers, body)
    assert [r.status.value for r in delivery.results] == ["applied"]
    assert [i for i, _ in delivery.rejected] == [1] and delivery.http_status == 400
    assert store.get("shop", first).state is State.SUCCEEDED


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj)  # ensure_ascii: a lone surrogate goes as \\ud800
