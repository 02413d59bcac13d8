"""A routed operation's late effect at the provider it left, in that provider's settlement
report (payorch.recon with payorch.routing), on SQLite, PostgreSQL and Citus.

The operation moved from acquirer A to B on proof (a listed decline); A's issuer approved
after all. A's report names A's attempt key (Adyen's merchant reference, or the payorch_ref
tag in Stripe's metadata), which no operation row holds: the row is matched to the routed
operation by the moves away from A, and flagged as a second effect, never settling the
operation at B. Importing calls no provider: both ledgers are counted before and after.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from routing_helpers import (
    A,
    B,
    WebhookOnly,
    adapters,
    executor,
    money,
    pay,
    reconciler,
    sample,
)

from payorch.core import State
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.outcome import Outcome
from payorch.providers.sandbox import SandboxServer
from payorch.recon import ReconPolicy, RowClass, import_report
from payorch.reconciling._crossings import CROSS_REVERSAL, DuplicatePolicy
from payorch.reconciling._fallback_watch import FallbackWatch
from payorch.routing import key_at
from payorch.storage._store import Store

FORMATS = ["stripe", "adyen"]


def moved_then_approved_at_a(
    store: Store, a: SandboxServer, b: SandboxServer, *, b_fault: str | None = None
) -> tuple[Outcome, dict[str, Any]]:
    """A declines (a listed code), the payment moves to B; then A's issuer approves."""
    providers = adapters(a.url, b.url)
    a.inject("decline")
    if b_fault is not None:
        b.inject(b_fault)
    out = pay(executor(store, providers, declines=("generic_decline",)))
    assert out.provider == B
    (declined,) = a.ledger()
    a.overturn(declined["id"])
    return out, declined


def report(sandbox: SandboxServer, fmt: str) -> bytes:
    return sandbox.settlement_report(format=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_late_effect_in_the_left_providers_report_is_a_flagged_duplicate(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer], fmt: str
) -> None:
    a, b = acquirers
    out, late = moved_then_approved_at_a(store, a, b)
    assert out.state is State.SUCCEEDED
    before = store.get("shop", out.operation_id)
    assert len(money(a)) == 1 and len(money(b)) == 1

    result = import_report(store, report(a, fmt), provider=A, format=fmt)

    assert result.counts == {"duplicate": 1, "other": 1}, result.counts
    (dup,) = [v for v in result.verdicts if v.klass is RowClass.DUPLICATE]
    assert dup.operation is not None and dup.operation.id == out.operation_id
    assert dup.detail["matched_by"] == "attempt_key"
    crossed = dup.detail["cross_provider"]
    assert crossed["provider"] == A
    if fmt == "stripe":  # the sandbox's Adyen report names its effects by PSP references
        assert crossed["reference"] == late["id"]
    assert before.route is not None
    assert crossed["attempt_key"] == key_at(before.route, A)
    assert crossed["operation_provider"] == B
    assert crossed["operation_reference"] == before.provider_reference
    # Flagged, never rewritten: it stands succeeded at B with B's effect.
    after = store.get("shop", out.operation_id)
    assert after.needs_attention and after.state is State.SUCCEEDED
    assert (after.provider, after.provider_reference) == (B, before.provider_reference)
    assert store.events("shop", out.operation_id)[-1].kind == "settlement_duplicate"
    # B's report: its own effect, matched; the flag stays for a human.
    own = import_report(store, report(b, fmt), provider=B, format=fmt)
    assert own.counts == {"matched": 1, "other": 1}, own.counts
    assert store.get("shop", out.operation_id).needs_attention
    assert len(money(a)) == 1 and len(money(b)) == 1  # importing called no provider


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_late_effect_never_settles_the_operation_unknown_at_its_next_provider(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer], fmt: str
) -> None:
    a, b = acquirers
    out, late = moved_then_approved_at_a(store, a, b, b_fault="drop_after")
    assert out.state is State.OUTCOME_UNKNOWN and out.provider_reference is None

    first = import_report(store, report(a, fmt), provider=A, format=fmt)

    assert first.counts == {"duplicate": 1, "other": 1}, first.counts
    record = store.get("shop", out.operation_id)
    # A's effect is not B's answer: the operation is still unknown at B, and flagged.
    assert record.state is State.OUTCOME_UNKNOWN and record.provider_reference is None
    assert record.provider == B and record.needs_attention
    # B's report settles it with B's own effect; the earlier flag is kept.
    (b_effect,) = money(b)
    second = import_report(store, report(b, fmt), provider=B, format=fmt)
    assert second.counts == {"settles_unknown": 1, "other": 1}, second.counts
    settled = store.get("shop", out.operation_id)
    assert settled.state is State.SUCCEEDED and settled.needs_attention
    assert settled.provider_reference == b_effect["id"] != late["id"]
    assert len(money(a)) == 1 and len(money(b)) == 1


def test_a_duplicate_the_reconciler_already_reversed_is_not_flagged_again(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    out, late = moved_then_approved_at_a(store, a, b)
    providers = adapters(a.url, b.url)
    rec = reconciler(store, providers, DuplicatePolicy.REVERSE)
    watch = FallbackWatch(store=store, crossings=rec.crossings, ages=(timedelta(0),))
    assert watch.run() == {"refunded": 1}
    (refund,) = money(a, "refund.create")
    kinds = [e.kind for e in store.events("shop", out.operation_id)]

    result = import_report(store, report(a, "stripe"), provider=A, format="stripe")

    verdicts = {v.klass: v for v in result.verdicts}
    assert result.counts == {"duplicate": 1, "matched": 1, "other": 1}, result.counts
    # The late capture: known to the operation, recorded as such, no second flag.
    assert verdicts[RowClass.DUPLICATE].detail["known"]
    assert [e.kind for e in store.events("shop", out.operation_id)] == kinds
    # The policy's refund is its own operation's effect at A.
    matched = verdicts[RowClass.MATCHED].operation
    assert matched is not None and matched.operation == "refund.create"
    assert matched.provider_reference == refund["id"]
    assert len(money(a)) == 1 and len(money(b)) == 1 and late["id"] == refund["payment_intent"]


@pytest.mark.parametrize(
    ("lookback", "found"), [(None, "orphan"), (timedelta(days=120), "duplicate")]
)
def test_the_moves_are_read_back_as_far_as_the_lookback(
    store: Store,
    acquirers: tuple[SandboxServer, SandboxServer],
    lookback: timedelta | None,
    found: str,
) -> None:
    a, b = acquirers
    a.advance(timedelta(days=90))  # A books its effects 90 days after the move
    moved_then_approved_at_a(store, a, b)
    policy = ReconPolicy() if lookback is None else ReconPolicy(moved_lookback=lookback)
    # The default (60 days) does not reach the move: its key is held by no one.
    assert (policy.moved_lookback > timedelta(days=90)) is (found == "duplicate")
    result = import_report(store, report(a, "adyen"), provider=A, format="adyen", policy=policy)
    assert result.counts == {found: 1, "other": 1}, result.counts
    assert len(money(a)) == 1 and len(money(b)) == 1


def test_an_unrouted_operation_found_by_its_tags_is_judged_as_before(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, _ = acquirers
    (at_a, *_) = adapters(a.url, a.url)
    plain = Executor(store=store, providers=[at_a], registry=default_registry(A))
    out = pay(plain)
    assert out.state is State.SUCCEEDED and not out.routed
    # The same report imported under another provider's name: found by its namespace tags.
    result = import_report(store, report(a, "stripe"), provider=B, format="stripe")
    assert result.counts == {"matched": 1, "other": 1}, result.counts
    assert not store.get("shop", out.operation_id).needs_attention
    assert len(money(a)) == 1


def test_a_webhook_only_provider_s_row_is_reversed_by_the_daemon_s_look(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    out, late = moved_then_approved_at_a(store, a, b)
    counted = sample("payorch_route_cross_provider_duplicates_total", provider=A)
    escalated = sample("payorch_escalations_total", reason="cross_provider")
    import_report(store, report(a, "stripe"), provider=A, format="stripe")
    assert sample("payorch_route_cross_provider_duplicates_total", provider=A) == counted + 1
    assert sample("payorch_escalations_total", reason="cross_provider") == escalated + 1
    cannot_ask = WebhookOnly(base_url=a.url, name=A)
    try:
        rec = reconciler(store, [cannot_ask, *adapters(a.url, b.url)[1:]], DuplicatePolicy.REVERSE)
        watch = FallbackWatch(store=store, crossings=rec.crossings, ages=(timedelta(0),))
        # What the row told stands in for a status query A cannot answer.
        assert watch.run() == {"refunded": 1}
    finally:
        cannot_ask.close()
    # Counted once, when the row raised it, not again by the look.
    assert sample("payorch_route_cross_provider_duplicates_total", provider=A) == counted + 1
    (refund,) = money(a, "refund.create")
    assert refund["payment_intent"] == late["id"]
    kinds = [e.kind for e in store.events("shop", out.operation_id)]
    assert kinds.count("settlement_duplicate") == 1 and kinds.count(CROSS_REVERSAL) == 1
    assert len(money(a)) == 1 and len(money(b)) == 1


def test_an_open_operation_at_another_provider_is_never_settled_by_a_row(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, _ = acquirers
    (at_a, *_) = adapters(a.url, a.url)
    plain = Executor(store=store, providers=[at_a], registry=default_registry(A))
    a.inject("drop_after")
    out = pay(plain)
    assert out.state is State.OUTCOME_UNKNOWN and not out.routed
    # A's report imported under another provider's name: it names the operation by its tags.
    result = import_report(store, report(a, "stripe"), provider=B, format="stripe")
    assert result.counts == {"orphan": 1, "other": 1}, result.counts
    (orphan,) = [v for v in result.verdicts if v.klass is RowClass.ORPHAN]
    assert out.operation_id in orphan.detail["note"]
    record = store.get("shop", out.operation_id)
    assert record.state is State.OUTCOME_UNKNOWN and record.provider_reference is None
    assert len(money(a)) == 1
