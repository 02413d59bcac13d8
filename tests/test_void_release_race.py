"""A Stripe void racing its own confirmation (issue 34): ``payment_intent.canceled`` of an
authorised intent, read as ``succeeded`` with lifecycle ``authorization_released``, arrives
while the operation's void is in flight. The hold is gone: the operation must end as the void
ends it (``failed_final``, code ``voided``), never ``succeeded`` and replayed to the client.

The Stripe emulator runs on loopback (its intents are the ledger); the store is real (SQLite
and PostgreSQL). The event is the one Stripe sends for the cancel our void made: its
``request.idempotency_key`` is the void's key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import httpx
from stripe_emulator import StripeEmulator

from payorch.core import State
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.operator import void
from payorch.outcome import Outcome, WebhookStatus
from payorch.provider import Answer, AnswerKind, VoidRequest
from payorch.providers.stripe import SIGNATURE_HEADER, StripeProvider
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.reconciling._webhooks import WebhookHandler
from payorch.storage._store import Store
from payorch.testing import Fault

TENANT = "shop"
AUTH = {"amount": 2000, "currency": "usd", "payment_method": "pm_card_visa"}


class Voiding:
    """The Stripe adapter with its void replaced for one test."""

    def __init__(self, inner: StripeProvider, void: Callable[[VoidRequest], Answer]) -> None:
        self._inner = inner
        self.void = void

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def executor_on(store: Store, stripe: StripeProvider) -> Executor:
    return Executor(
        store=store,
        providers=[stripe],
        registry=default_registry("stripe"),
        lease=timedelta(minutes=5),
        sleep=lambda _seconds: None,
    )


def authorise(executor: Executor, key: str) -> Outcome:
    return executor.execute(
        tenant_id=TENANT,
        operation="payment.create",
        idempotency_key=key,
        request={**AUTH, "capture_method": "manual"},
    )


def reconciler_on(store: Store, adapter: Voiding) -> Reconciler:
    return Reconciler(
        store=store,
        providers=[adapter],
        policy=ReconcilerPolicy(lease=timedelta(minutes=5)),
        owner="test-reconciler",
    )


def canceled_event(
    emulator: StripeEmulator, intent: dict[str, Any], caused_by: str | None
) -> tuple[dict[str, str], bytes]:
    """Stripe's signed ``payment_intent.canceled`` for ``intent``, caused by the request
    under the idempotency key ``caused_by`` (None: a cancel in the dashboard)."""
    stamp = int(time.time())
    event = {
        "id": f"evt_{intent['id'][3:]}",
        "object": "event",
        "type": "payment_intent.canceled",
        "created": stamp,
        "api_version": "2024-06-20",
        "livemode": False,
        "pending_webhooks": 1,
        "data": {"object": intent},
        "request": {"id": "req_cancel", "idempotency_key": caused_by},
    }
    body = json.dumps(event).encode()
    signed = f"{stamp}.".encode() + body
    digest = hmac.new(emulator.webhook_secret.encode(), signed, hashlib.sha256).hexdigest()
    return {SIGNATURE_HEADER: f"t={stamp},v1={digest}"}, body


def voided(store: Store, operation_id: str) -> None:
    record = store.get(TENANT, operation_id)
    assert (record.state, record.error_code, record.resolution) == (
        State.FAILED_FINAL,
        "voided",
        "void",
    )


def test_a_cancel_webhook_racing_the_void_settles_the_operation_voided(
    store: Store, stripe_emulator: StripeEmulator
) -> None:
    stripe = stripe_emulator.adapter()
    executor = executor_on(store, stripe)
    stripe_emulator.inject(Fault.DROP_AFTER_COMMIT)  # authorised; the answer never came back
    unknown = authorise(executor, "order-race")
    assert unknown.state is State.OUTCOME_UNKNOWN
    key = store.get(TENANT, unknown.operation_id).downstream_key
    assert stripe_emulator.effects(key) == 1  # the hold exists at Stripe
    handler = WebhookHandler(store=store, providers=[stripe])
    results = []

    def void_then_webhook(request: VoidRequest) -> Answer:
        # Stripe cancels the intent, and its webhook is taken before the void's answer.
        answer = stripe.void(request)
        (intent,) = stripe_emulator.intents(key)
        assert intent["status"] == "canceled"
        headers, body = canceled_event(stripe_emulator, intent, caused_by=request.void_key)
        results.append(handler.handle(TENANT, "stripe", headers, body))
        return answer

    rec = reconciler_on(store, Voiding(stripe, void_then_webhook))
    ended = void(store, rec, TENANT, unknown.operation_id, reason="stuck", actor="alice")

    (applied,) = results
    assert applied.status is WebhookStatus.APPLIED
    assert ended.outcome == "lost_race"  # the webhook settled it first, as the void would
    voided(store, unknown.operation_id)
    assert stripe_emulator.voided(key)  # nothing is held at Stripe
    # The client's retry gets the void's final decline, never a success to ship against.
    retry = authorise(executor, "order-race")
    assert retry.replayed and retry.state is State.FAILED_FINAL
    assert retry.error_code == "voided"
    assert stripe_emulator.effects(key) == 1  # one authorisation, whatever came after


def test_a_release_after_a_void_found_nothing_is_the_voids_outcome(
    store: Store, stripe_emulator: StripeEmulator
) -> None:
    """Stripe's search lagged (the void found nothing: unknown, ``void_nothing_found``); the
    merchant then cancels the intent in the dashboard. The release is the void's outcome."""
    stripe = stripe_emulator.adapter()
    executor = executor_on(store, stripe)
    stripe_emulator.inject(Fault.DROP_AFTER_COMMIT)
    unknown = authorise(executor, "order-lag")
    key = store.get(TENANT, unknown.operation_id).downstream_key
    nothing = Answer(kind=AnswerKind.NOT_FOUND, code="resource_missing")
    rec = reconciler_on(store, Voiding(stripe, lambda _request: nothing))
    searched = void(store, rec, TENANT, unknown.operation_id, reason="stuck", actor="alice")
    assert searched.outcome == "void_nothing_found"
    (intent,) = stripe_emulator.intents(key)
    # The merchant's own cancel, no idempotency key of ours.
    canceled = httpx.post(
        f"{stripe_emulator.url}/v1/payment_intents/{intent['id']}/cancel",
        data={"cancellation_reason": "requested_by_customer"},
        headers={"Authorization": f"Bearer {stripe_emulator.api_key}"},
    )
    assert canceled.status_code == 200 and stripe_emulator.voided(key)
    headers, body = canceled_event(stripe_emulator, canceled.json(), caused_by=None)

    result = WebhookHandler(store=store, providers=[stripe]).handle(TENANT, "stripe", headers, body)

    assert result.status is WebhookStatus.APPLIED
    voided(store, unknown.operation_id)
    assert store.get(TENANT, unknown.operation_id).provider_reference == intent["id"]
    retry = authorise(executor, "order-lag")
    assert retry.replayed and (retry.state, retry.error_code) == (State.FAILED_FINAL, "voided")
    assert stripe_emulator.effects(key) == 1
