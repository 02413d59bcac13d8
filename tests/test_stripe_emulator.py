"""The Stripe adapter against :class:`StripeEmulator`, a Stripe-shaped API on loopback:
real HTTP, Stripe's Idempotency-Key semantics, a ledger of effects per key, faults and
signed webhooks. Each test counts effects in the ledger, not only answers."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from stripe_emulator import stripe_emulator

from payorch.errors import ProviderIdempotencyError, WebhookSignatureInvalid
from payorch.provider import Answer, AnswerKind, StatusQuery, SubmitRequest, VoidRequest
from payorch.providers.stripe import StripeProvider
from payorch.providers.stripe.emulator import StripeEmulator
from payorch.testing import Emulator, Fault
from payorch.testing._requests import status_query, submit_request, void_request

__all__ = ["stripe_emulator"]  # the fixture, used by name below


@pytest.fixture
def emulator(stripe_emulator: StripeEmulator) -> StripeEmulator:
    return stripe_emulator


@pytest.fixture
def adapter(emulator: StripeEmulator) -> StripeProvider:
    return emulator.adapter()


def payment(emulator: StripeEmulator, **overrides: Any) -> SubmitRequest:
    return submit_request(emulator.payload("payment.create", **overrides))


def authorised(emulator: StripeEmulator, adapter: StripeProvider) -> tuple[SubmitRequest, str]:
    request = payment(emulator, capture_method="manual")
    answer = adapter.submit(request)
    assert answer.kind is AnswerKind.SUCCEEDED, answer
    assert answer.provider_reference is not None
    assert emulator.intents(request.downstream_key)[0]["status"] == "requires_capture"
    return request, answer.provider_reference


def test_it_is_an_emulator_of_the_adapter_kit(emulator: StripeEmulator) -> None:
    assert isinstance(emulator, Emulator)
    assert emulator.faults == frozenset(Fault)
    assert emulator.batches is False
    assert emulator.url.startswith("http://127.0.0.1:")


# -- submissions -------------------------------------------------------------------------------


def test_a_payment_succeeds_once_and_its_replay_makes_no_second_effect(
    emulator: StripeEmulator, adapter: StripeProvider
) -> None:
    request = payment(emulator)
    first = adapter.submit(request)
    again = adapter.submit(request)
    assert first.kind is again.kind is AnswerKind.SUCCEEDED
    assert first.provider_reference == again.provider_reference
    assert again.message is not None and "Idempotent-Replayed" in again.message
    assert emulator.effects(request.downstream_key) == 1
    assert len(emulator.intents(request.downstream_key)) == 1
    sent = [r for r in emulator.requests() if r["method"] == "POST"]
    assert [r["idempotency_key"] for r in sent] == [request.downstream_key] * 2


def test_the_same_key_with_other_parameters_is_refused(
    emulator: StripeEmulator, adapter: StripeProvider
) -> None:
    request = payment(emulator)
    assert adapter.submit(request).kind is AnswerKind.SUCCEEDED
    other = SubmitRequest(
        tenant_id=request.tenant_id,
        operation=request.operation,
        operation_id=request.operation_id,
        downstream_key=request.downstream_key,
        payload=dict(request.payload) | {"amount": 999},
        idempotency_key=request.idempotency_key,
        fingerprint=request.fingerprint,
    )
    with pytest.raises(ProviderIdempotencyError):
        adapter.submit(other)
    assert emulator.effects(request.downstream_key) == 1


@pytest.mark.parametrize("how", ["payment_method", "fault"])
def test_a_decline_is_final_and_makes_no_effect(
    emulator: StripeEmulator, adapter: StripeProvider, how: str
) -> None:
    if how == "fault":
        request = payment(emulator)
        emulator.inject(Fault.DECLINE)
    else:
        request = payment(emulator, payment_method="pm_card_chargeDeclinedInsufficientFunds")
    for _ in range(2):  # the key's decline is replayed, not run again
        answer = adapter.submit(request)
        assert (answer.kind, answer.status_code) == (AnswerKind.DECLINED, 402)
        assert answer.code in ("generic_decline", "insufficient_funds")
        assert answer.provider_reference == emulator.intents(request.downstream_key)[0]["id"]
    assert emulator.effects(request.downstream_key) == 0


def test_a_drop_after_commit_is_ambiguous_and_the_same_key_finds_the_one_effect(
    emulator: StripeEmulator, adapter: StripeProvider
) -> None:
    request = payment(emulator)
    emulator.inject(Fault.DROP_AFTER_COMMIT)
    lost = adapter.submit(request)
    assert lost.kind is AnswerKind.AMBIGUOUS, lost
    assert emulator.effects(request.downstream_key) == 1
    again = adapter.submit(request)
    assert again.kind is AnswerKind.SUCCEEDED
    assert again.provider_reference == emulator.intents(request.downstream_key)[0]["id"]
    assert emulator.effects(request.downstream_key) == 1


@pytest.mark.parametrize(
    ("fault", "kind", "effects"),
    [
        (Fault.RATE_LIMITED, AnswerKind.NOT_SENT, 0),
        (Fault.ERROR_BEFORE_COMMIT, AnswerKind.AMBIGUOUS, 0),
        (Fault.ERROR_AFTER_COMMIT, AnswerKind.AMBIGUOUS, 1),
        # Stripe-Should-Retry with idempotency_key_in_use: the key may be acting elsewhere.
        (Fault.IN_FLIGHT, AnswerKind.AMBIGUOUS, 0),
    ],
)
def test_each_fault_is_classified_and_the_retry_makes_one_effect(
    emulator: StripeEmulator,
    adapter: StripeProvider,
    fault: Fault,
    kind: AnswerKind,
    effects: int,
) -> None:
    request = payment(emulator)
    emulator.inject(fault)
    assert adapter.submit(request).kind is kind
    assert emulator.effects(request.downstream_key) == effects
    assert adapter.submit(request).kind is AnswerKind.SUCCEEDED
    assert emulator.effects(request.downstream_key) == 1


def test_a_key_still_executing_is_in_use(emulator: StripeEmulator, adapter: StripeProvider) -> None:
    request = payment(emulator)
    answers: list[Answer] = []
    with emulator.hold() as gate:
        first = threading.Thread(target=lambda: answers.append(adapter.submit(request)))
        first.start()
        assert gate.entered.wait(10)
        with emulator.adapter() as second:
            busy = second.submit(request)
        gate.release()
        first.join(10)
    assert (busy.kind, busy.status_code, busy.code) == (
        AnswerKind.AMBIGUOUS,
        409,
        "idempotency_key_in_use",
    )
    assert [a.kind for a in answers] == [AnswerKind.SUCCEEDED]
    assert emulator.effects(request.downstream_key) == 1


def test_an_unreachable_emulator_was_not_sent(emulator: StripeEmulator) -> None:
    request = payment(emulator)
    unreachable = emulator.unreachable_adapter()
    assert unreachable.submit(request).kind is AnswerKind.NOT_SENT
    assert unreachable.query_status(status_query(request)).kind is AnswerKind.NOT_SENT
    assert emulator.requests() == []


def test_a_wrong_api_key_is_refused_before_anything_runs(emulator: StripeEmulator) -> None:
    request = payment(emulator)
    answer = emulator.adapter(api_key="sk_test_wrong").submit(request)
    assert (answer.kind, answer.code) == (AnswerKind.NOT_SENT, "provider_auth_failed")
    assert emulator.effects(request.downstream_key) == 0


# -- status queries ------------------------------------------------------------------------------


def test_a_status_query_finds_the_payment_by_search_and_by_reference(
    emulator: StripeEmulator, adapter: StripeProvider
) -> None:
    request = payment(emulator)
    reference = adapter.submit(request).provider_reference
    by_search = adapter.query_status(status_query(request))
    by_reference = adapter.query_status(status_query(request, reference))
    for answer in (by_search, by_reference):
        assert (answer.kind, answer.provider_reference) == (AnswerKind.SUCCEEDED, reference)
    paths = [r["path"] for r in emulator.requests() if r["method"] == "GET"]
    assert paths[0] == "/v1/payment_intents/search"
    assert emulator.effects(request.downstream_key) == 1


def test_a_key_never_sent_is_not_found(emulator: StripeEmulator, adapter: StripeProvider) -> None:
    request = payment(emulator)
    assert adapter.query_status(status_query(request)).kind is AnswerKind.NOT_FOUND


def test_a_capture_and_a_refund_move_money_under_their_own_keys(
    emulator: StripeEmulator, adapter: StripeProvider
) -> None:
    _, intent = authorised(emulator, adapter)
    capture = submit_request({"payment_intent": intent}, operation="payment.capture")
    assert adapter.submit(capture).kind is AnswerKind.SUCCEEDED
    assert adapter.submit(capture).kind is AnswerKind.SUCCEEDED  # replayed
    refund = submit_request({"payment_intent": intent, "amount": 500}, operation="refund.create")
    refunded = adapter.submit(refund)
    assert refunded.kind is AnswerKind.SUCCEEDED
    assert refunded.provider_reference is not None
    assert refunded.provider_reference.startswith("re_")
    assert emulator.effects(capture.downstream_key) == emulator.effects(refund.downstream_key) == 1
    found = adapter.query_status(
        StatusQuery(
            tenant_id=refund.tenant_id,
            operation="refund.create",
            operation_id=refund.operation_id,
            downstream_key=refund.downstream_key,
            provider_reference=None,
            payload=refund.payload,
            idempotency_key=refund.idempotency_key,
        )
    )
    assert (found.kind, found.provider_reference) == (
        AnswerKind.SUCCEEDED,
        refunded.provider_reference,
    )


def test_the_listing_finds_what_payorch_made(
    emulator: StripeEmulator, adapter: StripeProvider
) -> None:
    request = payment(emulator)
    reference = adapter.submit(request).provider_reference
    emulator.seed_intent("succeeded")  # not payorch's: no tags, not listed
    now = datetime.now(UTC)
    listed = list(adapter.list_effects(now - timedelta(minutes=1), now + timedelta(minutes=1)))
    assert [(e.provider_reference, e.kind) for e in listed] == [(reference, AnswerKind.SUCCEEDED)]
    assert listed[0].tags["payorch_ref"] == request.downstream_key.split(":")[1]


# -- voids -------------------------------------------------------------------------------------


def test_a_void_releases_an_authorisation_once(
    emulator: StripeEmulator, adapter: StripeProvider
) -> None:
    request, intent = authorised(emulator, adapter)
    assert not emulator.voided(request.downstream_key)
    void = void_request(request)  # no reference: found by search
    for _ in range(2):  # sent again after a crash: the same void
        answer = adapter.void(void)
        assert (answer.kind, answer.provider_reference) == (AnswerKind.SUCCEEDED, intent)
    assert emulator.voided(request.downstream_key)
    cancels = [r for r in emulator.requests() if r["path"].endswith("/cancel")]
    assert [r["idempotency_key"] for r in cancels] == [void.void_key]  # then already canceled
    assert cancels[0]["fields"] == [("cancellation_reason", "abandoned")]
    # What the operation became: authorised, then released (still its success).
    after = adapter.query_status(status_query(request, intent))
    assert after.kind is AnswerKind.SUCCEEDED


def test_a_void_by_reference_cancels_that_intent(
    emulator: StripeEmulator, adapter: StripeProvider
) -> None:
    request, intent = authorised(emulator, adapter)
    answer = adapter.void(void_request(request, intent))
    assert (answer.kind, answer.provider_reference) == (AnswerKind.SUCCEEDED, intent)
    assert emulator.voided(request.downstream_key)


def test_a_captured_payment_cannot_be_voided(
    emulator: StripeEmulator, adapter: StripeProvider
) -> None:
    request = payment(emulator)
    intent = adapter.submit(request).provider_reference
    answer = adapter.void(void_request(request, intent))
    assert (answer.kind, answer.code) == (AnswerKind.DECLINED, "already_captured")
    assert not emulator.voided(request.downstream_key)
    assert emulator.effects(request.downstream_key) == 1


def test_a_void_of_nothing_is_not_found(emulator: StripeEmulator, adapter: StripeProvider) -> None:
    request = payment(emulator)
    assert adapter.void(void_request(request)).kind is AnswerKind.NOT_FOUND
    assert not emulator.voided(request.downstream_key)


def test_a_void_meets_faults_as_any_call(emulator: StripeEmulator, adapter: StripeProvider) -> None:
    request, _ = authorised(emulator, adapter)
    void = void_request(request)
    emulator.inject(Fault.RATE_LIMITED)
    assert adapter.void(void).kind is AnswerKind.NOT_SENT
    emulator.inject(Fault.DROP_AFTER_COMMIT)
    assert adapter.void(void).kind is AnswerKind.AMBIGUOUS
    assert emulator.voided(request.downstream_key)
    assert adapter.void(void).kind is AnswerKind.SUCCEEDED


def test_only_a_payment_create_is_voidable(
    emulator: StripeEmulator, adapter: StripeProvider
) -> None:
    refund = submit_request(emulator.payload("refund.create"), operation="refund.create")
    answer = adapter.void(
        VoidRequest(
            tenant_id=refund.tenant_id,
            operation="refund.create",
            operation_id=refund.operation_id,
            downstream_key=refund.downstream_key,
            provider_reference=None,
        )
    )
    assert (answer.kind, answer.code) == (AnswerKind.DECLINED, "not_voidable")
    assert emulator.requests() == []


# -- webhooks ------------------------------------------------------------------------------------


def test_a_signed_delivery_verifies_and_a_tampered_one_is_refused(
    emulator: StripeEmulator, adapter: StripeProvider
) -> None:
    request = payment(emulator)
    intent = adapter.submit(request).provider_reference
    headers, body = emulator.delivery([request.downstream_key])
    event = adapter.parse_webhook(headers, body)
    assert (event.event_type, event.outcome) == ("payment_intent.succeeded", AnswerKind.SUCCEEDED)
    assert (event.provider_reference, event.downstream_key) == (intent, request.downstream_key)
    headers, body = emulator.delivery([request.downstream_key], tampered={0})
    with pytest.raises(WebhookSignatureInvalid):
        adapter.parse_webhook(headers, body)


def test_a_declined_payment_is_delivered_as_payment_failed(
    emulator: StripeEmulator, adapter: StripeProvider
) -> None:
    request = payment(emulator, payment_method="pm_card_chargeDeclined")
    assert adapter.submit(request).kind is AnswerKind.DECLINED
    event = adapter.parse_webhook(*emulator.delivery([request.downstream_key]))
    assert (event.event_type, event.outcome, event.code) == (
        "payment_intent.payment_failed",
        AnswerKind.DECLINED,
        "generic_decline",
    )


def test_a_voided_authorisation_is_delivered_as_released(
    emulator: StripeEmulator, adapter: StripeProvider
) -> None:
    request, _ = authorised(emulator, adapter)
    assert adapter.void(void_request(request)).kind is AnswerKind.SUCCEEDED
    event = adapter.parse_webhook(*emulator.delivery([request.downstream_key]))
    assert (event.event_type, event.outcome, event.lifecycle) == (
        "payment_intent.canceled",
        AnswerKind.SUCCEEDED,
        "authorization_released",
    )


def test_a_delivery_carries_one_event(emulator: StripeEmulator, adapter: StripeProvider) -> None:
    requests = [payment(emulator), payment(emulator)]
    for request in requests:
        adapter.submit(request)
    with pytest.raises(ValueError, match="one event"):
        emulator.delivery([r.downstream_key for r in requests])


# -- async -------------------------------------------------------------------------------------


def test_the_async_adapter_meets_the_same_emulator(emulator: StripeEmulator) -> None:
    import asyncio

    request, adapter = payment(emulator, capture_method="manual"), emulator.adapter()

    async def run() -> list[Answer]:
        try:
            submitted = await adapter.asubmit(request)
            replayed = await adapter.asubmit(request)
            voided = await adapter.avoid(void_request(request))
            return [submitted, replayed, voided]
        finally:
            await adapter.aclose()

    answers = asyncio.run(run())
    assert [a.kind for a in answers] == [AnswerKind.SUCCEEDED] * 3
    assert len({a.provider_reference for a in answers}) == 1
    assert emulator.effects(request.downstream_key) == 1
    assert emulator.voided(request.downstream_key)
