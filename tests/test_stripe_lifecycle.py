"""Stripe events map to the operation they concern, and read the same as a status query.

A small Stripe double on ``httpx.MockTransport`` keeps PaymentIntents shaped as Stripe's API
reference documents them; webhooks are built from the same stored objects, so the webhook
path and the status-query path are fed the same evidence.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
from conftest import RecordingSleep, make_due

from payorch import WebhookHandler, WebhookStatus
from payorch.core import State
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.provider import AnswerKind, StatusQuery
from payorch.providers.stripe import SIGNATURE_HEADER, StripeProvider
from payorch.reconciling import _operator as operator
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.storage._queries import list_operations
from payorch.storage._store import Store

BASE = "https://api.stripe.test"
SECRET = "whsec_test_lifecycle"
TENANT = "shop"
DECLINE = {
    "type": "card_error",
    "code": "card_declined",
    "decline_code": "insufficient_funds",
    "message": "Your card has insufficient funds.",
}


class StripeDouble:
    """PaymentIntents held as Stripe holds them; ``fail_next`` answers 500 after committing."""

    def __init__(self) -> None:
        self.intents: dict[str, dict[str, Any]] = {}
        self.fail_next = False
        self.searches: list[str] = []  # the search queries received

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path == "/v1/payment_intents":
            return self._answer(self._create(request))
        if request.method == "POST" and path.endswith("/capture"):
            intent = self.intents[path.split("/")[3]]
            intent.update(status="succeeded", amount_capturable=0, amount_received=2000)
            return self._answer(intent)
        if path == "/v1/payment_intents/search":
            self.searches.append(request.url.params["query"])
            # metadata['<key>']:'<value>' (what the adapter asks; no escapes in these values)
            matched = re.fullmatch(r"metadata\['([^']+)'\]:'([^'\\]*)'", self.searches[-1])
            assert matched is not None, self.searches[-1]
            name, wanted = matched.groups()
            found = [i for i in self.intents.values() if i["metadata"].get(name) == wanted]
            return httpx.Response(
                200, json={"object": "search_result", "data": found, "has_more": False}
            )
        if request.method == "GET" and path.startswith("/v1/payment_intents/"):
            return httpx.Response(200, json=self.intents[path.split("/")[3]])
        raise AssertionError(f"unexpected call {request.method} {path}")

    def _create(self, request: httpx.Request) -> dict[str, Any]:
        form = {k: v[0] for k, v in parse_qs(request.content.decode()).items()}
        manual = form.get("capture_method") == "manual"
        ident = f"pi_{len(self.intents) + 1:04d}LkdIwHu7ix28a3tqPa"
        intent = {
            "id": ident,
            "object": "payment_intent",
            "amount": int(form["amount"]),
            "amount_capturable": int(form["amount"]) if manual else 0,
            "amount_received": 0 if manual else int(form["amount"]),
            "canceled_at": None,
            "cancellation_reason": None,
            "capture_method": "manual" if manual else "automatic",
            "currency": form["currency"],
            "last_payment_error": None,
            "latest_charge": f"ch_{ident[3:]}",
            "metadata": {
                k[len("metadata[") : -1]: v for k, v in form.items() if k.startswith("metadata[")
            },
            "status": "requires_capture" if manual else "succeeded",
        }
        self.intents[ident] = intent
        return intent

    def _answer(self, intent: dict[str, Any]) -> httpx.Response:
        if self.fail_next:  # committed, but the answer is a 500: the caller cannot know
            self.fail_next = False
            return httpx.Response(500, json={"error": {"type": "api_error"}})
        return httpx.Response(200, json=intent)

    def only(self) -> dict[str, Any]:
        (intent,) = self.intents.values()
        return intent

    def of(self, store: Store, operation_id: str) -> dict[str, Any]:
        """The intent made for an operation: tagged with its namespace ref (not its id)."""
        ref = store.get(TENANT, operation_id).downstream_key.split(":")[1]
        (intent,) = [i for i in self.intents.values() if i["metadata"].get("payorch_ref") == ref]
        return intent

    def cancel(self, intent: dict[str, Any], reason: str) -> None:
        """What Stripe does on POST /cancel (the merchant's call, not ours)."""
        intent.update(
            status="canceled",
            cancellation_reason=reason,
            amount_capturable=0,
            canceled_at=int(time.time()),
        )

    def decline(self, intent: dict[str, Any], error: dict[str, Any]) -> None:
        intent.update(
            status="requires_payment_method",
            last_payment_error=error,
            amount_received=0,
            amount_capturable=0,
        )


@pytest.fixture
def stripe_double() -> StripeDouble:
    return StripeDouble()


@pytest.fixture
def stripe(stripe_double: StripeDouble) -> Iterator[StripeProvider]:
    with StripeProvider(
        api_key="sk_test_x",
        webhook_secret=SECRET,
        base_url=BASE,
        transport=httpx.MockTransport(stripe_double.handler),
    ) as provider:
        yield provider


@pytest.fixture
def executor(store: Store, stripe: StripeProvider) -> Executor:
    return Executor(
        store=store,
        providers=[stripe],
        registry=default_registry("stripe"),
        lease=timedelta(minutes=5),  # outlasts the adapter's default call budget
        sleep=RecordingSleep(),
    )


@pytest.fixture
def handler(store: Store, stripe: StripeProvider) -> WebhookHandler:
    return WebhookHandler(store=store, providers=[stripe])


def pay(executor: Executor, key: str, *, manual: bool = True) -> str:
    request: dict[str, Any] = {"amount": 2000, "currency": "EUR", "payment_method": "pm_card_visa"}
    if manual:
        request["capture_method"] = "manual"
    outcome = executor.execute(
        tenant_id=TENANT, operation="payment.create", idempotency_key=key, request=request
    )
    return outcome.operation_id


def webhook(
    handler: WebhookHandler,
    event_type: str,
    obj: dict[str, Any],
    *,
    event_id: str,
    idempotency_key: str | None = None,
) -> Any:
    event = {
        "id": event_id,
        "object": "event",
        "created": int(time.time()),
        "type": event_type,
        "data": {"object": json.loads(json.dumps(obj))},
        "request": {"id": None, "idempotency_key": idempotency_key},
    }
    body = json.dumps(event).encode()
    t = int(time.time())
    digest = hmac.new(SECRET.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return handler.handle(TENANT, "stripe", {SIGNATURE_HEADER: f"t={t},v1={digest}"}, body)


def reconcile(store: Store, stripe: StripeProvider, operation_id: str) -> None:
    make_due(store, operation_id)
    Reconciler(
        store=store, providers=[stripe], policy=ReconcilerPolicy(lease=timedelta(minutes=5))
    ).reconcile_once()


def attention(store: Store) -> list[str]:
    return [r.id for r in list_operations(store, needs_attention=True).items]


# -- canceled after authorisation -------------------------------------------------------


@pytest.mark.parametrize("reason", ["requested_by_customer", "abandoned", "automatic"])
def test_released_authorisation_is_recorded_on_a_succeeded_payment_without_a_flag(
    store: Store,
    executor: Executor,
    handler: WebhookHandler,
    stripe_double: StripeDouble,
    reason: str,
) -> None:
    op_id = pay(executor, "order-1")
    authorised = store.get(TENANT, op_id)
    assert authorised.state is State.SUCCEEDED  # requires_capture: the authorisation
    intent = stripe_double.only()
    stripe_double.cancel(intent, reason)  # released (or expired, "automatic") uncaptured

    result = webhook(handler, "payment_intent.canceled", intent, event_id="evt_cancel")

    assert (result.status, result.operation_id, result.state) == (
        WebhookStatus.RECORDED,
        op_id,
        State.SUCCEEDED,
    )
    after = store.get(TENANT, op_id)
    assert (after.state, after.needs_attention, after.version) == (
        State.SUCCEEDED,
        False,
        authorised.version,
    )
    evidence = store.events(TENANT, op_id)[-1]
    assert evidence.kind == "webhook_evidence"
    assert evidence.detail is not None
    assert evidence.detail["event_type"] == "payment_intent.canceled"
    assert evidence.detail["lifecycle"] == "authorization_released"
    assert "conflicts_with" not in evidence.detail
    assert attention(store) == []


def test_status_query_reads_a_released_authorisation_as_the_webhook_does(
    store: Store,
    executor: Executor,
    handler: WebhookHandler,
    stripe: StripeProvider,
    stripe_double: StripeDouble,
) -> None:
    # Two operations whose outcome was lost, both authorised and then released: one is
    # settled by the webhook, the other by the reconciler's status query.
    ids = []
    for key in ("order-a", "order-b"):
        stripe_double.fail_next = True
        ids.append(pay(executor, key))
    assert [store.get(TENANT, i).state for i in ids] == [State.OUTCOME_UNKNOWN] * 2
    by_op = {i: stripe_double.of(store, i) for i in ids}
    for intent in by_op.values():
        stripe_double.cancel(intent, "requested_by_customer")

    hooked = webhook(handler, "payment_intent.canceled", by_op[ids[0]], event_id="evt_a")
    assert hooked.status is WebhookStatus.APPLIED
    reconcile(store, stripe, ids[1])

    settled = [store.get(TENANT, i) for i in ids]
    assert [r.state for r in settled] == [State.SUCCEEDED, State.SUCCEEDED]
    assert [r.error_code for r in settled] == [None, None]
    assert [r.provider_reference for r in settled] == [by_op[i]["id"] for i in ids]
    assert attention(store) == []


def test_a_cancel_before_any_authorisation_stays_a_failure(
    store: Store,
    executor: Executor,
    handler: WebhookHandler,
    stripe: StripeProvider,
    stripe_double: StripeDouble,
) -> None:
    stripe_double.fail_next = True
    op_id = pay(executor, "order-1")
    intent = stripe_double.only()
    stripe_double.decline(intent, DECLINE)  # the attempt failed: nothing authorised
    stripe_double.cancel(intent, "abandoned")

    result = webhook(handler, "payment_intent.canceled", intent, event_id="evt_cancel")

    assert (result.status, result.state) == (WebhookStatus.APPLIED, State.FAILED_FINAL)
    record = store.get(TENANT, op_id)
    assert record.error_code == "insufficient_funds"
    answer = stripe.query_status(
        StatusQuery(
            tenant_id=TENANT,
            operation="payment.create",
            operation_id=op_id,
            downstream_key=record.downstream_key,
            provider_reference=intent["id"],
        )
    )
    assert (answer.kind, answer.code) == (AnswerKind.DECLINED, record.error_code)


def test_a_cancel_of_a_never_authorised_intent_still_contradicts_a_success(
    store: Store, executor: Executor, handler: WebhookHandler, stripe_double: StripeDouble
) -> None:
    op_id = pay(executor, "order-1", manual=False)
    intent = dict(stripe_double.only(), latest_charge=None)
    stripe_double.cancel(intent, "duplicate")
    result = webhook(handler, "payment_intent.canceled", intent, event_id="evt_cancel")
    assert result.status is WebhookStatus.CONFLICT
    assert attention(store) == [op_id]
    # ... which an operator acknowledges once looked at: the queue empties.
    operator.acknowledge(store, TENANT, op_id, reason="test double", actor="alice")
    assert attention(store) == []
    assert store.get(TENANT, op_id).state is State.SUCCEEDED


# -- the operation an event concerns -------------------------------------------------------


def test_a_capture_event_settles_the_capture_not_the_payment(
    store: Store, executor: Executor, handler: WebhookHandler, stripe_double: StripeDouble
) -> None:
    create_id = pay(executor, "order-1")
    intent = stripe_double.only()
    stripe_double.fail_next = True
    capture = executor.execute(
        tenant_id=TENANT,
        operation="payment.capture",
        idempotency_key="capture-1",
        request={"payment_intent": intent["id"]},
    )
    assert capture.state is State.OUTCOME_UNKNOWN
    key = store.get(TENANT, capture.operation_id).downstream_key
    # The intent's metadata names payment.create; the event's request carries our capture key.
    result = webhook(
        handler, "payment_intent.succeeded", intent, event_id="evt_cap", idempotency_key=key
    )
    assert (result.status, result.operation_id) == (WebhookStatus.APPLIED, capture.operation_id)
    assert store.get(TENANT, capture.operation_id).state is State.SUCCEEDED
    assert store.get(TENANT, create_id).state is State.SUCCEEDED
    assert attention(store) == []


# -- one decline code, whichever evidence settled it ---------------------------------------


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (DECLINE, "insufficient_funds"),
        ({"type": "card_error", "code": "card_declined", "message": "declined"}, "card_declined"),
        ({"type": "card_error", "code": "expired_card", "message": "expired"}, "expired_card"),
    ],
)
def test_declines_carry_the_same_code_by_webhook_and_by_status_query(
    store: Store,
    executor: Executor,
    handler: WebhookHandler,
    stripe: StripeProvider,
    stripe_double: StripeDouble,
    error: dict[str, Any],
    code: str,
) -> None:
    ids = []
    for key in ("order-a", "order-b"):
        stripe_double.fail_next = True
        ids.append(pay(executor, key, manual=False))
    by_op = {i: stripe_double.of(store, i) for i in ids}
    for intent in by_op.values():
        stripe_double.decline(intent, error)

    hooked = webhook(handler, "payment_intent.payment_failed", by_op[ids[0]], event_id="evt_f")
    assert hooked.status is WebhookStatus.APPLIED
    reconcile(store, stripe, ids[1])

    by_webhook, by_query = (store.get(TENANT, i) for i in ids)
    assert by_webhook.state is by_query.state is State.FAILED_FINAL
    assert by_webhook.error_code == by_query.error_code == code
    assert by_webhook.response is not None and by_query.response is not None
    assert by_webhook.response["code"] == by_query.response["code"] == code
