"""Webhooks from a provider a routed operation moved away from (payorch.routing), on SQLite,
PostgreSQL and Citus.

The operation moved from acquirer A to B on proof (a listed decline), then A's issuer
approved after all. A's notifications name A's attempt key, which no operation row holds:
they are matched to the routed operation by the moves away from A. The decline's is
evidence about that attempt; the late approval is a cross-provider duplicate, flagged
critical, never the operation's outcome. Where A cannot be asked (a webhook-only acquirer),
the reconciler's look takes what A told as its evidence and applies the duplicate policy.
Effects are counted at both acquirers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from conftest import make_due
from routing_helpers import (
    A,
    B,
    WebhookOnly,
    adapters,
    executor,
    lost_then_routed_past_a,
    money,
    pay,
    reconciler,
    sample,
)

from payorch import WebhookHandler, WebhookStatus
from payorch.core import State
from payorch.provider import WebhookEvent
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._crossings import CROSS_DUPLICATE, CROSS_REVERSAL, DuplicatePolicy
from payorch.reconciling._fallback_watch import FallbackWatch
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.routing import key_at
from payorch.storage._store import Store


def handler(store: Store, a: SandboxServer) -> WebhookHandler:
    listener = SandboxProvider(base_url=a.url, name=A, webhook_secret=a.webhook_secret)
    return WebhookHandler(store=store, providers=[listener])


def moved_then_approved(store: Store, a: SandboxServer, b: SandboxServer) -> tuple[str, str]:
    """A declines (a listed code), the payment moves to B; A's issuer approves after all.
    The operation id and A's late effect's id."""
    a.inject("decline")
    out = pay(executor(store, adapters(a.url, b.url), declines=("generic_decline",)))
    assert out.state is State.SUCCEEDED and out.provider == B
    (declined,) = a.ledger()
    a.overturn(declined["id"])
    return out.operation_id, declined["id"]


def test_the_left_providers_late_approval_is_flagged_never_applied(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    op_id, late = moved_then_approved(store, a, b)
    before = store.get("shop", op_id)
    duplicates = sample("payorch_route_cross_provider_duplicates_total", provider=A)
    escalated = sample("payorch_escalations_total", reason="cross_provider")
    hooks = handler(store, a)

    decline, approval = a.webhook_deliveries()
    declined = hooks.handle("shop", A, decline.headers, decline.body)
    approved = hooks.handle("shop", A, approval.headers, approval.body)
    again = hooks.handle("shop", A, approval.headers, approval.body)

    # The decline: evidence about A's attempt, kept on the operation; nothing changes.
    assert (declined.status, declined.operation_id) == (WebhookStatus.RECORDED, op_id)
    # The approval: money at A beside B's, flagged critical with both effects.
    assert (approved.status, approved.operation_id) == (WebhookStatus.CONFLICT, op_id)
    assert again.status is WebhookStatus.DUPLICATE
    record = store.get("shop", op_id)
    assert record.needs_attention and record.state is State.SUCCEEDED
    assert (record.provider, record.provider_reference) == (B, before.provider_reference)
    (flag,) = [e for e in store.events("shop", op_id) if e.kind == CROSS_DUPLICATE]
    assert flag.detail is not None and flag.detail["severity"] == "critical"
    shown = {(e["provider"], e["provider_reference"]) for e in flag.detail["effects"]}
    assert shown == {(B, before.provider_reference), (A, late)}
    assert before.route is not None
    assert [e["downstream_key"] for e in flag.detail["effects"] if e["provider"] == A] == [
        key_at(before.route, A)
    ]
    assert sample("payorch_route_cross_provider_duplicates_total", provider=A) == duplicates + 1
    assert sample("payorch_escalations_total", reason="cross_provider") == escalated + 1
    assert len(money(a)) == 1 and len(money(b)) == 1  # a webhook moves no money


def test_a_webhook_only_provider_s_late_approval_is_reversed_by_the_daemon_s_look(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    op_id, late = moved_then_approved(store, a, b)
    _, approval = a.webhook_deliveries()
    assert handler(store, a).handle("shop", A, approval.headers, approval.body).operation_id
    cannot_ask = WebhookOnly(base_url=a.url, name=A)
    try:
        rec = reconciler(store, [cannot_ask, *adapters(a.url, b.url)[1:]], DuplicatePolicy.REVERSE)
        watch = FallbackWatch(store=store, crossings=rec.crossings, ages=(timedelta(0),))
        counts = watch.run()
        assert watch.check({("shop", op_id)}) == {"known": 1}  # a second look: nothing more
    finally:
        cannot_ask.close()

    assert counts == {"refunded": 1}, counts
    (refund,) = money(a, "refund.create")
    assert refund["payment_intent"] == late
    kinds = [e.kind for e in store.events("shop", op_id)]
    assert kinds.count(CROSS_DUPLICATE) == 1 and kinds.count(CROSS_REVERSAL) == 1
    assert len(money(a)) == 1 and len(money(b)) == 1  # both charges stay, one refunded


def test_without_what_it_told_a_provider_that_cannot_be_asked_is_unchecked(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    op_id, _ = moved_then_approved(store, a, b)
    cannot_ask = WebhookOnly(base_url=a.url, name=A)
    try:
        rec = reconciler(store, [cannot_ask, *adapters(a.url, b.url)[1:]], DuplicatePolicy.REVERSE)
        assert rec.crossings is not None
        assert rec.crossings.check(store.get("shop", op_id)) == ["unchecked"]
    finally:
        cannot_ask.close()
    assert not store.get("shop", op_id).needs_attention
    assert money(a, "refund.create") == [] and len(money(b)) == 1


class ReportsCaptures(SandboxProvider):
    """The sandbox adapter, its events read as reports on a capture (as Adyen's CAPTURE
    notifications name the operation type they report on)."""

    def _event_from(self, event: object, headers: Mapping[str, str]) -> WebhookEvent:
        return dataclasses.replace(super()._event_from(event, headers), operation="payment.capture")


def test_an_event_of_another_kind_under_the_left_key_is_evidence_not_money(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    op_id, _ = moved_then_approved(store, a, b)
    duplicates = sample("payorch_route_cross_provider_duplicates_total", provider=A)
    listener = ReportsCaptures(base_url=a.url, name=A, webhook_secret=a.webhook_secret)
    hooks = WebhookHandler(store=store, providers=[listener])
    _, approval = a.webhook_deliveries()
    result = hooks.handle("shop", A, approval.headers, approval.body)
    listener.close()
    assert (result.status, result.operation_id) == (WebhookStatus.RECORDED, op_id)
    record = store.get("shop", op_id)
    assert not record.needs_attention and record.state is State.SUCCEEDED
    assert CROSS_DUPLICATE not in [e.kind for e in store.events("shop", op_id)]
    assert sample("payorch_route_cross_provider_duplicates_total", provider=A) == duplicates
    assert len(money(a)) == 1 and len(money(b)) == 1


def test_a_late_approval_while_the_next_call_is_in_flight_never_fences_it_out(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    a.inject("decline")
    ex = executor(store, adapters(a.url, b.url), declines=("generic_decline",))
    with b.hold_commits() as gate, ThreadPoolExecutor(1) as pool:
        paying = pool.submit(pay, ex)
        assert gate.wait_held(1, 30)  # B's call is at B: the operation is held, in progress
        (declined,) = a.ledger()
        a.overturn(declined["id"])
        _, approval = a.webhook_deliveries()
        result = handler(store, a).handle("shop", A, approval.headers, approval.body)
        held = store.get("shop", result.operation_id or "")
        assert held.state is State.IN_PROGRESS and held.provider == B
        gate.release()
        out = paying.result(timeout=60)
    # The webhook kept its evidence without writing the row: B's answer was recorded.
    assert result.status is WebhookStatus.CONFLICT
    assert out.state is State.SUCCEEDED and out.provider == B and not out.replayed
    assert [e.kind for e in store.events("shop", out.operation_id)].count(CROSS_DUPLICATE) == 1
    # The daemon's look raises the flag from it, and its policy reverses A's charge.
    rec = reconciler(store, adapters(a.url, b.url), DuplicatePolicy.REVERSE)
    watch = FallbackWatch(store=store, crossings=rec.crossings, ages=(timedelta(0),))
    assert watch.run() == {"refunded": 1}
    assert store.get("shop", out.operation_id).needs_attention
    assert len(money(a)) == 1 and len(money(b)) == 1 and len(money(a, "refund.create")) == 1


def test_the_flag_outlives_the_next_providers_settling_webhook(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    a.inject("decline")
    b.inject("drop_after")
    out = pay(executor(store, adapters(a.url, b.url), declines=("generic_decline",)))
    assert out.state is State.OUTCOME_UNKNOWN and out.provider == B
    (declined,) = a.ledger()
    a.overturn(declined["id"])
    _, approval = a.webhook_deliveries()
    flagged = handler(store, a).handle("shop", A, approval.headers, approval.body)
    assert flagged.status is WebhookStatus.CONFLICT
    assert store.get("shop", out.operation_id).state is State.OUTCOME_UNKNOWN

    (b_success,) = b.webhook_deliveries()
    listener = SandboxProvider(base_url=b.url, name=B, webhook_secret=b.webhook_secret)
    settled = WebhookHandler(store=store, providers=[listener]).handle(
        "shop", B, b_success.headers, b_success.body
    )
    listener.close()
    assert settled.status is WebhookStatus.APPLIED
    record = store.get("shop", out.operation_id)
    assert record.state is State.SUCCEEDED and record.provider_reference != declined["id"]
    assert record.needs_attention  # the cross-provider flag stays until acknowledged
    assert len(money(a)) == 1 and len(money(b)) == 1


def test_a_provider_passed_over_as_unhealthy_is_matched_by_its_note(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    _, retry = lost_then_routed_past_a(store, adapters(a.url, b.url))
    assert len(money(a)) == 1 and len(money(b)) == 1

    (success,) = a.webhook_deliveries()
    result = handler(store, a).handle("shop", A, success.headers, success.body)

    assert (result.status, result.operation_id) == (WebhookStatus.CONFLICT, retry.operation_id)
    assert store.get("shop", retry.operation_id).needs_attention
    assert len(money(a)) == 1 and len(money(b)) == 1


def test_the_flag_outlives_the_reconcilers_settling_write(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    a.inject("decline")
    b.inject("drop_after")
    providers = adapters(a.url, b.url)
    out = pay(executor(store, providers, declines=("generic_decline",)))
    assert out.state is State.OUTCOME_UNKNOWN and out.provider == B
    (declined,) = a.ledger()
    a.overturn(declined["id"])
    _, approval = a.webhook_deliveries()
    assert handler(store, a).handle("shop", A, approval.headers, approval.body).operation_id
    # No adapter for A here: the cross-provider check cannot raise the flag again, so the
    # settling write alone must keep it.
    rec = Reconciler(
        store=store,
        providers=[providers[1]],
        policy=ReconcilerPolicy(not_found_grace=timedelta(0)),
        owner="reconciler-test",
    )
    make_due(store, out.operation_id)
    rec.run_until_idle()
    record = store.get("shop", out.operation_id)
    assert record.state is State.SUCCEEDED and record.provider == B
    assert record.needs_attention  # settled at B by its status, the flag kept
    assert len(money(a)) == 1 and len(money(b)) == 1
