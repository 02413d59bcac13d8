"""Redaction by value, and re-sending (issue 25, item 8b/c): an expiry month of 12 leaves every
other 12 in the stored evidence; a request whose stored copy holds ``[redacted]`` anywhere
(nested in ``metadata`` too) is never sent again from the store: the operation is escalated.
Each test counts what reached the sandbox: its received requests and its ledger."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from conftest import FAST_TIMEOUT, LoopThread, RecordingSleep, age, make_due
from pydantic import BaseModel, Field
from test_redaction import (
    CARD,
    CARD_CHARGE,
    EXPIRY_CHARGE,
    SECRETS,
    YEAR_CHARGE,
    charge,
    dump,
    expiring_charge,
)

from payorch.core import State
from payorch.errors import ProviderUnavailable
from payorch.execution._executor import Executor, RetryPolicy
from payorch.operations import REDACTED, OperationType, default_registry
from payorch.operator import recheck
from payorch.provider import Answer, Capability, SubmitRequest
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._async import AsyncReconciler
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.records import OperationRecord, Redactor
from payorch.storage._async_store import AsyncStore
from payorch.storage._store import Store


def submissions(sandbox: SandboxServer) -> list[dict[str, Any]]:
    """The request bodies the sandbox received for new operations, as JSON."""
    return [
        json.loads(r["body"])
        for r in sandbox.requests()
        if r["method"] == "POST" and r["path"].startswith("/v1/operations/")
    ]


def placeholders_sent(sandbox: SandboxServer) -> int:
    return sum(REDACTED in json.dumps(body) for body in submissions(sandbox))


def reconciler(store: Store, provider: SandboxProvider, **policy: Any) -> Reconciler:
    return Reconciler(
        store=store,
        providers=[provider],
        policy=ReconcilerPolicy(lease=timedelta(seconds=30), **policy),
        owner="test-reconciler",
    )


class ReplayOnly(SandboxProvider):
    """A provider that cannot be asked for a status; a replay under the key is its answer."""

    @property
    def capabilities(self) -> frozenset[Capability]:
        return frozenset({Capability.REPLAY, Capability.WEBHOOKS})


# -- an expiry month of 12 and an amount of 12 ------------------------------------------------


def test_an_expiry_month_of_12_keeps_every_other_12_in_what_is_stored(
    executor: Executor, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    executor.registry.register(EXPIRY_CHARGE)
    answered = executor.execute(
        tenant_id="shop",
        operation="card.expiring",
        idempotency_key="o-answered",
        request=expiring_charge("o-answered"),
    )
    sandbox.inject("drop_after")  # settled by a status query, which echoes it all again
    queried = executor.execute(
        tenant_id="shop",
        operation="card.expiring",
        idempotency_key="o-queried",
        request=expiring_charge("o-queried"),
    )
    make_due(store, queried.operation_id)
    assert reconciler(store, sandbox_provider).reconcile_once().outcomes == Counter(
        {"succeeded": 1}
    )

    # The provider got the whole request, twice (the dropped answer and no re-send).
    sent = submissions(sandbox)
    assert len(sent) == 2 and placeholders_sent(sandbox) == 0
    assert {(b["amount"], b["exp_month"], b["card_number"]) for b in sent} == {(12, 12, CARD)}
    assert len(sandbox.ledger()) == 2

    first = store.get("shop", answered.operation_id)
    assert first.state is State.SUCCEEDED and first.request is not None
    assert first.request["amount"] == 12 and first.request["exp_month"] == REDACTED
    assert first.request["description"] == f"12 x 12 cm for {REDACTED}"
    assert first.request["metadata"] == {
        "quantity": "12",
        "card": REDACTED,
        "card_exp_month": REDACTED,  # its key names the sensitive field
        "order": "o-answered",
    }
    assert first.response is not None
    body = first.response["provider_response"]
    assert body["amount"] == 12 and body["metadata"]["quantity"] == "12"
    assert body["metadata"]["card"] == REDACTED
    (evidence,) = [e.detail for e in store.events("shop", first.id) if e.kind == "provider_answer"]
    assert evidence is not None and evidence["body"]["amount"] == 12

    second = store.get("shop", queried.operation_id)
    assert second.state is State.SUCCEEDED and second.response is not None
    (effect,) = second.response["provider_response"]["data"]  # the sandbox's listing
    assert effect["amount"] == 12 and effect["metadata"]["quantity"] == "12"
    assert effect["metadata"]["card"] == REDACTED
    assert effect["metadata"]["card_exp_month"] == REDACTED  # by name, from the stored copy

    text = dump(store)
    assert CARD not in text
    assert '"quantity": "12"' in text or '"quantity":"12"' in text


# -- a stored request with a nested placeholder is never sent again ---------------------------


class CardInMetadata(BaseModel):
    amount: int
    currency: str
    card_number: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    lines: list[dict[str, str]] = Field(default_factory=list)


CARD_IN_METADATA = OperationType(
    name="card.nested",
    model=CardInMetadata,
    effect_fields=("amount", "currency"),
    sensitive_fields=("card_number",),
    provider="sandbox",
)
# The app left the top-level field empty and put the card deeper, under the field's name:
# stored, only the nested copy is [redacted] (a top-level look sees a complete request).
NESTED = {
    "metadata.card_number": {"metadata": {"card_number": CARD, "order": "o-1"}},
    "lines[1].card_number": {"lines": [{"sku": "a"}, {"card_number": CARD}]},
}


def nested(where: str) -> dict[str, object]:
    return {"amount": 500, "currency": "EUR", **NESTED[where]}


def claimed_then_crashed(store: Store, where: str) -> OperationRecord:
    """What a worker leaves that died after its claim committed (attempt possibly sent)
    and before its request left: the reconciler finds nothing at the provider."""
    registry = default_registry("sandbox")
    registry.register(CARD_IN_METADATA)
    prepared = registry.prepare(
        tenant_id="shop", operation="card.nested", idempotency_key="k1", request=nested(where)
    )
    claim = store.claim(
        prepared.new, owner="executor:dead", lease=timedelta(seconds=30), possibly_sent=True
    )
    stored = claim.operation.request
    assert claim.created and stored is not None
    assert stored["card_number"] is None and REDACTED not in stored.values()
    assert REDACTED in json.dumps(stored) and CARD not in json.dumps(stored)
    return claim.operation


@pytest.mark.parametrize("where", sorted(NESTED))
@pytest.mark.parametrize("path", ["resubmission", "replay", "operator_recheck"])
def test_a_nested_placeholder_is_escalated_never_re_sent(
    store: Store, sandbox: SandboxServer, path: str, where: str
) -> None:
    """Every way back to the provider with the stored request: the reconciler's re-submission
    after "not found", its replay for a provider that cannot be asked, an operator's recheck."""
    record = claimed_then_crashed(store, where)
    make_due(store, record.id)
    age(store, record.id, timedelta(minutes=5))  # past the grace, well inside the key window
    provider_type = ReplayOnly if path == "replay" else SandboxProvider
    with provider_type(
        base_url=sandbox.url, webhook_secret=sandbox.webhook_secret, timeout=FAST_TIMEOUT
    ) as provider:
        rec = reconciler(store, provider, not_found_grace=timedelta(0), webhook_grace=timedelta(0))
        for _ in range(2):  # escalated, not settled: a later look escalates again, sends nothing
            if path == "operator_recheck":
                assert recheck(store, rec, "shop", record.id, actor="ops").outcome == "escalated"
            else:
                assert rec.reconcile_once().outcomes == Counter({"escalated": 1})
            make_due(store, record.id)

    after = store.get("shop", record.id)
    assert after.state is State.OUTCOME_UNKNOWN and after.needs_attention
    assert after.attempts == record.attempts  # no new attempt was recorded
    decision = [(e.detail or {}).get("decision", "") for e in store.events("shop", record.id)][-1]
    assert f"redacted at {where}" in decision and "cannot re-send" in decision
    assert submissions(sandbox) == [] and sandbox.ledger() == []


def test_the_async_reconciler_escalates_a_nested_placeholder_too(
    db_url: str, store: Store, sandbox: SandboxServer, loop_thread: LoopThread
) -> None:
    record = claimed_then_crashed(store, "metadata.card_number")
    make_due(store, record.id)
    age(store, record.id, timedelta(minutes=5))
    astore = AsyncStore.from_url(db_url)
    provider = SandboxProvider(base_url=sandbox.url, timeout=FAST_TIMEOUT)
    try:
        rec = AsyncReconciler(
            store=astore,
            providers=[provider],
            policy=ReconcilerPolicy(lease=timedelta(seconds=30), not_found_grace=timedelta(0)),
        )
        report = loop_thread.run(rec.reconcile_once())
    finally:
        loop_thread.run(provider.aclose())
        loop_thread.run(astore.close())
        provider.close()
    assert report.outcomes == Counter({"escalated": 1})
    assert store.get("shop", record.id).needs_attention
    assert submissions(sandbox) == [] and sandbox.ledger() == []


def test_a_sent_request_with_a_nested_placeholder_keeps_its_one_effect(
    executor: Executor, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    """A 500 before the provider committed: unknown, then not found; the stored copy holds
    ``metadata.card_number = [redacted]``, so it is escalated instead of re-submitted."""
    executor.registry.register(CARD_IN_METADATA)
    sandbox.inject("error_500_before")
    outcome = executor.execute(
        tenant_id="shop",
        operation="card.nested",
        idempotency_key="k1",
        request=nested("metadata.card_number"),
    )
    assert outcome.state is State.OUTCOME_UNKNOWN
    make_due(store, outcome.operation_id)
    age(store, outcome.operation_id, timedelta(minutes=5))
    report = reconciler(store, sandbox_provider, not_found_grace=timedelta(0)).reconcile_once()
    assert report.outcomes == Counter({"escalated": 1})
    record = store.get("shop", outcome.operation_id)
    assert record.state is State.OUTCOME_UNKNOWN and record.needs_attention
    (sent,) = submissions(sandbox)  # the first request only, carrying the real card
    assert sent["metadata"]["card_number"] == CARD and placeholders_sent(sandbox) == 0
    assert sandbox.ledger() == []  # the 500 came before the commit: no effect at all


class OptionalCvc(BaseModel):
    amount: int
    currency: str
    cvc: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


OPTIONAL_CVC = OperationType(
    name="card.optional",
    model=OptionalCvc,
    effect_fields=("amount", "currency"),
    sensitive_fields=("cvc",),
    provider="sandbox",
)


def test_a_request_whose_sensitive_field_was_empty_is_re_sent_whole(
    executor: Executor, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    """Nothing redacted (the sensitive field was null, a "12" sits in metadata): the stored
    copy is the request as sent, so the reconciler re-submits it, byte for byte the same."""
    executor.registry.register(OPTIONAL_CVC)
    sandbox.inject("error_500_before")
    request = {"amount": 12, "currency": "EUR", "metadata": {"quantity": "12"}}
    outcome = executor.execute(
        tenant_id="shop", operation="card.optional", idempotency_key="k1", request=request
    )
    make_due(store, outcome.operation_id)
    age(store, outcome.operation_id, timedelta(minutes=5))
    report = reconciler(store, sandbox_provider, not_found_grace=timedelta(0)).reconcile_once()
    assert report.outcomes == Counter({"resubmitted_succeeded": 1})
    first, again = submissions(sandbox)
    assert first == again and again["cvc"] is None and again["metadata"]["quantity"] == "12"
    assert len(sandbox.ledger()) == 1


# -- where the caller holds the full request, the real one is sent ---------------------------


def test_a_take_over_and_inline_retries_send_the_callers_real_request(
    executor: Executor, store: Store, sandbox: SandboxServer
) -> None:
    """Every inline attempt refused (released), then the client's retry takes the operation
    over: each attempt carries the card, none the placeholder, and one effect is made."""
    executor.registry.register(CARD_CHARGE)
    sandbox.inject("rate_limit", times=RetryPolicy().max_attempts)
    with pytest.raises(ProviderUnavailable) as caught:
        executor.execute(
            tenant_id="shop", operation="card.charge", idempotency_key="k1", request=charge("o-1")
        )
    released = store.get("shop", caught.value.operation_id)
    assert released.released and released.request is not None
    assert released.request["metadata"]["card"] == REDACTED

    outcome = executor.execute(
        tenant_id="shop", operation="card.charge", idempotency_key="k1", request=charge("o-1")
    )
    assert outcome.state is State.SUCCEEDED and outcome.operation_id == released.id
    sent = submissions(sandbox)
    assert len(sent) >= 2 and placeholders_sent(sandbox) == 0
    assert {b["metadata"]["card"] for b in sent} == {CARD}
    assert {b["card_number"] for b in sent} == {CARD}
    (effect,) = sandbox.ledger()
    assert effect["metadata"]["card"] == CARD  # what the provider holds is whole
    text = dump(store)
    assert all(secret not in text for secret in SECRETS)


# -- a card number sent as a number, and the parts of a sensitive object ------------------------

PAN = 4242424242424242  # the card number as a JSON number
CVC = "737"


class EchoingProvider(SandboxProvider):
    """The sandbox, with an answer that echoes the card under names of its own (as a card
    API's payment-method details do), outside anything payorch sent in metadata."""

    def submit(self, request: SubmitRequest) -> Answer:
        answer = super().submit(request)
        sent, echo = request.payload, dict(answer.body or {})
        if sent.get("card_number") is not None:
            number = sent["card_number"]
            echo.update(card={"number": number, "brand": "visa"}, pan=number)
            answer = replace(answer, message=f"card {number} charged")
        if isinstance(card := sent.get("card"), dict):
            echo.update(
                source={"cvc": card["cvc"], "exp_month": card["exp_month"]},
                checks={"result": card["cvc"]},
            )
        return replace(answer, body=echo)


class CardCharge12(BaseModel):
    amount: int
    currency: str
    quantity: str
    card_number: int | None = None
    exp_month: int | None = None
    card: dict[str, Any] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


NUMBER_CARD = OperationType(
    name="card.number",
    model=CardCharge12,
    effect_fields=("amount", "currency"),
    sensitive_fields=("card_number", "exp_month"),
    provider="sandbox",
)
OBJECT_CARD = OperationType(
    name="card.object",
    model=CardCharge12,
    effect_fields=("amount", "currency"),
    sensitive_fields=("card",),
    provider="sandbox",
)
# An amount of 12 and a "12" quantity beside an expiry month of 12; the app copies the card
# number (a number) or the CVC into metadata.
NUMBER_REQUEST = {"card_number": PAN, "exp_month": 12, "metadata": {"ref": PAN}}
OBJECT_REQUEST = {
    "card": {"number": CARD, "cvc": CVC, "exp_month": 12},
    "metadata": {"card_cvc": CVC},
}


def charged(
    store: Store, sandbox: SandboxServer, op_type: OperationType, request: dict[str, Any]
) -> tuple[OperationRecord, OperationRecord]:
    """Two operations: one answered (the echo above), one settled by a status query."""
    records: list[str] = []
    with EchoingProvider(
        base_url=sandbox.url, webhook_secret=sandbox.webhook_secret, timeout=FAST_TIMEOUT
    ) as provider:
        registry = default_registry("sandbox")
        registry.register(op_type)
        executor = Executor(
            store=store,
            providers=[provider],
            registry=registry,
            lease=timedelta(seconds=30),
            owner="test-executor",
            sleep=RecordingSleep(),
        )
        for order in ("o-answered", "o-queried"):
            if order == "o-queried":
                sandbox.inject("drop_after")
            metadata = {**request["metadata"], "order": order, "size": 12, "qty": "12"}
            outcome = executor.execute(
                tenant_id="shop",
                operation=op_type.name,
                idempotency_key=order,
                request={
                    "amount": 12,
                    "currency": "EUR",
                    "quantity": "12",
                    **request,
                    "metadata": metadata,
                },
            )
            records.append(outcome.operation_id)
        make_due(store, records[1])
        outcomes = reconciler(store, provider).reconcile_once().outcomes
    assert outcomes == Counter({"succeeded": 1})
    # The provider got the whole request, each once, and made one effect each.
    sent = submissions(sandbox)
    assert len(sent) == 2 and placeholders_sent(sandbox) == 0
    assert all(b[k] == v for b in sent for k, v in request.items() if k != "metadata")
    assert len(sandbox.ledger()) == 2
    answered, queried = (store.get("shop", op) for op in records)
    assert answered.state is queried.state is State.SUCCEEDED
    return answered, queried


def kept_12s(stored: Mapping[str, Any] | None) -> None:
    """What has nothing to do with the card: as it was."""
    assert stored is not None and stored["amount"] == 12
    assert stored["metadata"]["size"] == 12 and stored["metadata"]["qty"] == "12"


def test_a_card_number_sent_as_a_number_is_stored_nowhere(
    store: Store, sandbox: SandboxServer
) -> None:
    answered, queried = charged(store, sandbox, NUMBER_CARD, NUMBER_REQUEST)
    request = answered.request
    kept_12s(request)
    assert request is not None and request["quantity"] == "12"
    assert request["card_number"] == request["exp_month"] == request["metadata"]["ref"] == REDACTED
    assert answered.response is not None
    (evidence,) = [
        e.detail for e in store.events("shop", answered.id) if e.kind == "provider_answer"
    ]
    assert evidence is not None and evidence["message"] == f"card {REDACTED} charged"
    for echoed in (answered.response["provider_response"], evidence["body"]):
        kept_12s(echoed)
        # Under names the request never used: hidden by value, the number being long.
        assert echoed["card"] == {"number": REDACTED, "brand": "visa"}
        assert echoed["pan"] == echoed["metadata"]["ref"] == REDACTED
    assert queried.response is not None
    (effect,) = queried.response["provider_response"]["data"]  # the sandbox's listing
    kept_12s(effect)
    assert effect["metadata"]["ref"] == REDACTED  # by name, from the stored copy
    text = dump(store)
    assert str(PAN) not in text
    assert '"qty": "12"' in text or '"qty":"12"' in text


def test_the_parts_of_a_sensitive_card_object_are_stored_nowhere(
    store: Store, sandbox: SandboxServer
) -> None:
    answered, queried = charged(store, sandbox, OBJECT_CARD, OBJECT_REQUEST)
    request = answered.request
    kept_12s(request)
    assert request is not None and request["quantity"] == "12"
    # A digit-only CVC goes under a name naming the field (card_cvc holds cvc's words).
    assert request["card"] == request["metadata"]["card_cvc"] == REDACTED
    assert answered.response is not None
    (evidence,) = [
        e.detail for e in store.events("shop", answered.id) if e.kind == "provider_answer"
    ]
    assert evidence is not None
    for echoed in (answered.response["provider_response"], evidence["body"]):
        kept_12s(echoed)
        # The card's own keys are sensitive names. Its CVC is digits alone, under 8: like an
        # expiry year, it goes only under a sensitive name (the documented limit).
        assert echoed["source"] == {"cvc": REDACTED, "exp_month": REDACTED}
        assert echoed["checks"] == {"result": CVC}
        assert echoed["metadata"]["card_cvc"] == REDACTED
    assert queried.response is not None
    (effect,) = queried.response["provider_response"]["data"]
    kept_12s(effect)
    assert effect["metadata"]["card_cvc"] == REDACTED  # by name, from the stored copy
    assert CARD not in dump(store)


# -- an amount equal to the card's expiry year -------------------------------------------------


@pytest.mark.parametrize("year", [2030, "2030"])
def test_an_amount_equal_to_the_expiry_year_is_kept_and_re_submitted(
    executor: Executor, store: Store, sandbox: SandboxServer, year: int | str
) -> None:
    """Released by the provider, then the caller's retry takes it over: the amount of 2030
    is in the stored request, the answer and its evidence; only the card itself is hidden."""
    executor.registry.register(YEAR_CHARGE)
    request = {
        "amount": 2030,
        "currency": "EUR",
        "card": {"number": CARD, "exp_year": year},
        "metadata": {"order": "o-1"},
    }
    sandbox.inject("rate_limit", times=RetryPolicy().max_attempts)
    with pytest.raises(ProviderUnavailable):
        executor.execute(
            tenant_id="shop", operation="card.year", idempotency_key="k1", request=request
        )
    outcome = executor.execute(
        tenant_id="shop", operation="card.year", idempotency_key="k1", request=request
    )
    assert outcome.state is State.SUCCEEDED
    record = store.get("shop", outcome.operation_id)
    assert record.request is not None and record.request["amount"] == 2030
    assert Redactor.redacted_at(record.request) == "card"
    assert record.response is not None
    assert record.response["provider_response"]["amount"] == 2030
    bodies = [
        e.detail["body"] for e in store.events("shop", record.id) if e.kind == "provider_answer"
    ]
    assert bodies and all(b is None or b["amount"] == 2030 for b in bodies)
    assert any(b is not None and b["amount"] == 2030 for b in bodies)
    sent = submissions(sandbox)
    assert len(sent) >= 2 and placeholders_sent(sandbox) == 0
    assert {b["amount"] for b in sent} == {2030}
    assert len(sandbox.ledger()) == 1
    assert CARD not in dump(store)
