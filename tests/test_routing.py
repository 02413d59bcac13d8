"""Routing across two acquirers on loopback (payorch.routing), on SQLite, PostgreSQL and Citus.

Every test counts the effects at both providers: a move to the second acquirer happens only
on proof that the first attempt did not execute, and an effect that surfaces at the first
one later is found, flagged and reversed by policy.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import workers
from cli_helpers import run as cli_run
from conftest import FAST_TIMEOUT, RecordingSleep, age, make_due
from routing_helpers import (
    OPEN,
    A,
    B,
    adapters,
    executor,
    money,
    pay,
    reconciler,
    sample,
    stopped,
)

from payorch.core import State
from payorch.errors import NoRoute, OperationNotFound
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._crossings import (
    CROSS_DUPLICATE,
    CROSS_REVERSAL,
    DuplicatePolicy,
)
from payorch.reconciling._fallback_watch import FallbackWatch
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.routing import Router, Rule, attempts_of
from payorch.storage._store import Store


def routing_counts() -> tuple[float, ...]:
    return (
        sample("payorch_route_attempts_total", provider=A),
        sample("payorch_route_attempts_total", provider=B),
        sample("payorch_route_fallbacks_total", from_provider=A, to_provider=B, proof="not_sent"),
        sample("payorch_route_cross_provider_duplicates_total", provider=A),
    )


def test_first_acquirer_down_second_serves_with_one_effect(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    a.stop()  # connection refused: certainly not sent
    providers = adapters(a.url, b.url)
    ex = executor(store, providers)
    before = routing_counts()
    out = pay(ex)
    assert out.state is State.SUCCEEDED and out.provider == B and out.routed
    after = routing_counts()
    assert [x - y for x, y in zip(after, before, strict=True)] == [1, 1, 1, 0]
    record = store.get("shop", out.operation_id)
    steps = attempts_of(record.route)
    assert [s["provider"] for s in steps] == [A, B]
    assert steps[0]["proof"] == "not_sent"
    assert steps[0]["downstream_key"] != steps[1]["downstream_key"] == record.downstream_key
    assert record.route is not None and record.route["providers"] == [A, B]
    kinds = [e.kind for e in store.events("shop", out.operation_id)]
    assert kinds == ["claimed", "fallback", "provider_answer"]
    # The client's retry is the same operation and answer, the settling provider named.
    again = pay(ex)
    assert again.replayed and again.operation_id == out.operation_id and again.provider == B
    assert len(money(b)) == 1 and a.ledger() == []
    assert b.effects_for(record.downstream_key)[0]["status"] == "succeeded"


def test_a_timeout_after_commit_stays_with_the_first_and_is_reconciled(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    providers = adapters(a.url, b.url)
    ex = executor(store, providers)
    a.inject("drop_after")  # committed at A, the answer never comes
    out = pay(ex)
    assert out.state is State.OUTCOME_UNKNOWN and out.provider == A
    record = store.get("shop", out.operation_id)
    assert [s["provider"] for s in attempts_of(record.route)] == [A]
    assert b.ledger() == []  # an unknown never falls over
    make_due(store, out.operation_id)
    reconciler(store, providers, DuplicatePolicy.REVERSE).run_until_idle()
    settled = store.get("shop", out.operation_id)
    assert settled.state is State.SUCCEEDED and settled.provider == A
    assert len(money(a)) == 1 and b.ledger() == []
    assert pay(ex).provider == A


def test_a_listed_decline_moves_on_and_an_unlisted_one_is_final(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    providers = adapters(a.url, b.url)
    listed = executor(store, providers, declines=("generic_decline",))
    a.inject("decline")
    out = pay(listed, "listed")
    assert out.state is State.SUCCEEDED and out.provider == B
    steps = attempts_of(store.get("shop", out.operation_id).route)
    assert (steps[0]["proof"], steps[0]["code"]) == ("listed_decline", "generic_decline")
    # By default no decline code is listed: a decline is the final answer.
    a.inject("decline")
    final = pay(executor(store, providers), "unlisted")
    assert final.state is State.FAILED_FINAL and final.provider == A
    assert [e["status"] for e in a.ledger()] == ["declined", "declined"]
    assert len(money(a)) == 0 and len(money(b)) == 1


@pytest.mark.parametrize("policy", [DuplicatePolicy.REVERSE, DuplicatePolicy.OPERATOR])
def test_a_late_success_after_a_proven_fallback_is_flagged_and_the_policy_applies(
    db_url: str,
    store: Store,
    acquirers: tuple[SandboxServer, SandboxServer],
    policy: DuplicatePolicy,
) -> None:
    a, b = acquirers
    providers = adapters(a.url, b.url)
    a.inject("decline")
    out = pay(executor(store, providers, declines=("generic_decline",)))
    assert out.state is State.SUCCEEDED and out.provider == B
    (declined,) = a.ledger()
    a.overturn(declined["id"])  # the issuer approves after all: money moved at both
    assert len(money(a)) == 1 and len(money(b)) == 1
    rec = reconciler(store, providers, policy)
    watch = FallbackWatch(store=store, crossings=rec.crossings, ages=(timedelta(0),))
    duplicates = sample("payorch_route_cross_provider_duplicates_total", provider=A)
    counts = watch.run()
    assert sample("payorch_route_cross_provider_duplicates_total", provider=A) == duplicates + 1
    assert counts == {"refunded" if policy is DuplicatePolicy.REVERSE else "flagged": 1}
    record = store.get("shop", out.operation_id)
    assert record.needs_attention and record.state is State.SUCCEEDED and record.provider == B
    events = store.events("shop", out.operation_id)
    (flag,) = [e for e in events if e.kind == CROSS_DUPLICATE]
    assert flag.detail is not None and flag.detail["severity"] == "critical"
    shown = {(e["provider"], e["provider_reference"]) for e in flag.detail["effects"]}
    assert shown == {(B, record.provider_reference), (A, declined["id"])}
    refunds = money(a, "refund.create")
    if policy is DuplicatePolicy.REVERSE:
        (reversal,) = [e for e in events if e.kind == CROSS_REVERSAL]
        assert reversal.detail is not None and reversal.detail["how"] == "refund"
        assert [r["payment_intent"] for r in refunds] == [declined["id"]]
    else:
        assert refunds == []
    # The operator sees each attempt per provider, the late effect and what became of it.
    shown_cli = cli_run(db_url, "ops", "show", out.operation_id)
    assert shown_cli.exit_code == 0, shown_cli.output
    text = " ".join(shown_cli.output.split())
    assert "route eu: acquirer_a > acquirer_b" in text
    assert f"LATE EFFECT {declined['id']} (flagged)" in text
    assert f"succeeded ref={record.provider_reference}" in text
    assert ("refund" in text) is (policy is DuplicatePolicy.REVERSE)
    # A second look finds the same effects and does nothing more.
    assert watch.check({("shop", out.operation_id)}) == {"known" if refunds else "flagged": 1}
    assert len(money(a, "refund.create")) == len(refunds)
    assert len(money(a)) == 1 and len(money(b)) == 1  # both effects stay visible


def test_sigkill_between_the_move_and_the_second_call_leaves_one_effect(
    db_url: str, store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    a.stop()
    workers.run_routed_until_killed(db_url, a.url, b.url, "crash-route")
    record = store.get_by_namespace("shop", "payment.create", "crash-route")
    assert record.state is State.IN_PROGRESS and record.provider == B and record.possibly_sent
    assert b.ledger() == [] and a.ledger() == []
    make_due(store, record.id)
    reconciler(store, adapters(a.url, b.url), DuplicatePolicy.REVERSE).run_until_idle()
    done = store.get("shop", record.id)
    assert done.state is State.SUCCEEDED and done.provider == B
    # Re-sent at B under B's own key, the request the move kept: one effect in all.
    assert len(b.effects_for(done.downstream_key)) == 1
    assert len(money(b)) == 1 and a.ledger() == []


def test_a_request_no_rule_matches_is_refused_and_nothing_is_stored(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    rule = Rule(operation="payment.create", providers=[A, B], currencies=["EUR"])
    ex = Executor(
        store=store,
        providers=adapters(a.url, b.url),
        registry=default_registry(A),
        router=Router([rule]),
    )
    with pytest.raises(NoRoute) as caught:
        pay(ex, currency="USD")
    assert caught.value.http_status == 422 and caught.value.operation == "payment.create"
    assert "payment.create" in caught.value.message
    with pytest.raises(OperationNotFound):
        store.get_by_namespace("shop", "payment.create", "order-1")
    assert a.ledger() == [] and b.ledger() == []


def test_the_stored_route_is_replayed_when_every_provider_was_down(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    from payorch.errors import ProviderUnavailable

    a, b = acquirers
    down = stopped()
    with pytest.raises(ProviderUnavailable):
        pay(executor(store, adapters(down, down)))
    record = store.get_by_namespace("shop", "payment.create", "order-1")
    assert record.released and record.route is not None
    # The client retries; the routing table now prefers B first, but the namespace follows
    # the route it was stored with, resuming where it stood.
    rule = Rule(operation="payment.create", providers=[B, A])
    ex = Executor(
        store=store,
        providers=adapters(down, b.url),
        registry=default_registry(A),
        sleep=RecordingSleep(),
        router=Router([rule], health=None),
    )
    out = pay(ex)
    assert out.state is State.SUCCEEDED and out.provider == B
    stored = store.get("shop", out.operation_id)
    assert stored.route is not None and stored.route["providers"] == [A, B]
    assert len(money(b)) == 1 and a.ledger() == []


def test_not_found_past_the_window_moves_the_unknown_to_the_next_provider(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    providers = adapters(a.url, b.url)
    a.inject("error_500_before")  # possibly sent, nothing committed at A
    out = pay(executor(store, providers))
    assert out.state is State.OUTCOME_UNKNOWN and out.provider == A
    rec = reconciler(store, providers, DuplicatePolicy.REVERSE)
    make_due(store, out.operation_id)
    # Within A's window a "not found" is re-sent to A under A's key, never moved on.
    a.inject("error_500_before")
    rec.run_until_idle(max_passes=1)
    assert store.get("shop", out.operation_id).provider == A and b.ledger() == []
    age(store, out.operation_id, timedelta(hours=25))  # A's window (24 h) has passed
    make_due(store, out.operation_id)
    rec.run_until_idle()
    done = store.get("shop", out.operation_id)
    assert done.state is State.SUCCEEDED and done.provider == B
    steps = attempts_of(done.route)
    assert [(s["provider"], s.get("proof")) for s in steps] == [
        (A, "not_found_past_window"),
        (B, None),
    ]
    assert a.ledger() == [] and len(money(b)) == 1


def test_a_void_the_provider_confirmed_moves_the_authorisation_on(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    providers = adapters(a.url, b.url)
    a.inject("pending")  # held at A, not settled
    out = pay(executor(store, providers), capture_method="manual")
    assert out.provider == A and out.state is not State.SUCCEEDED
    rec = Reconciler(
        store=store,
        providers=providers,
        policy=ReconcilerPolicy(void_after=timedelta(hours=1), not_found_grace=timedelta(0)),
        owner="reconciler-test",
    )
    age(store, out.operation_id, timedelta(hours=2))  # A's attempt: past the void deadline
    make_due(store, out.operation_id)
    b.inject("error_500_before")  # B's first answer is lost: B's attempt is unknown a while
    rec.run_until_idle(max_passes=1)
    moved = store.get("shop", out.operation_id)
    assert moved.provider == B and moved.state is State.OUTCOME_UNKNOWN
    # A's reference stays with A's attempt: B's is asked for under B's key alone, and the
    # void wanted of A is not B's.
    (held,) = a.ledger()
    assert attempts_of(moved.route)[0]["reference"] == held["id"]
    assert moved.provider_reference is None and moved.resolution is None
    make_due(store, out.operation_id)
    rec.run_until_idle()
    done = store.get("shop", out.operation_id)
    assert done.provider == B and done.state is State.SUCCEEDED
    assert attempts_of(done.route)[0]["proof"] == "voided"
    assert [e["status"] for e in a.ledger()] == ["voided"]
    assert [e["status"] for e in b.ledger()] == ["succeeded"] and len(money(b)) == 1
    assert done.provider_reference == b.ledger()[0]["id"]


def test_an_answer_that_proves_nothing_never_falls_over(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    from payorch.provider import Answer, AnswerKind, SubmitRequest

    class Unsure(SandboxProvider):
        """An adapter that cannot tell a refused connection from a lost answer."""

        def submit(self, request: SubmitRequest) -> Answer:
            answer = super().submit(request)
            if answer.kind is AnswerKind.NOT_SENT:
                return Answer(kind=AnswerKind.AMBIGUOUS, code="unsure")
            return answer

    a, b = acquirers
    a.stop()
    unsure = Unsure(base_url=a.url, name=A, timeout=FAST_TIMEOUT)
    OPEN.append(unsure)
    out = pay(executor(store, [unsure, adapters(a.url, b.url)[1]]))
    assert out.state is State.OUTCOME_UNKNOWN and out.provider == A
    assert [s["provider"] for s in attempts_of(store.get("shop", out.operation_id).route)] == [A]
    assert a.ledger() == [] and b.ledger() == []


def test_a_route_standing_at_a_provider_not_configured_here_is_released_untouched(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    from payorch.errors import ConfigurationError, ProviderUnavailable

    a, b = acquirers
    down = stopped()
    with pytest.raises(ProviderUnavailable):
        pay(executor(store, adapters(down, down)))  # released, standing at B
    only_a = Executor(
        store=store,
        providers=[adapters(a.url, b.url)[0]],
        registry=default_registry(A),
        router=Router([Rule(operation="payment.create", providers=[A])], health=None),
    )
    with pytest.raises(ConfigurationError, match="stands at provider 'acquirer_b'"):
        pay(only_a)
    record = store.get_by_namespace("shop", "payment.create", "order-1")
    assert record.released and record.provider == B
    assert a.ledger() == [] and b.ledger() == []
    out = pay(executor(store, adapters(a.url, b.url)))  # the next request, with B here
    assert out.state is State.SUCCEEDED and out.provider == B
    assert len(money(b)) == 1 and a.ledger() == []


def test_an_operators_recheck_of_a_settled_routed_operation_asks_the_providers_it_left(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    from payorch.operator import recheck

    a, b = acquirers
    providers = adapters(a.url, b.url)
    a.inject("decline")
    out = pay(executor(store, providers, declines=("generic_decline",)))
    rec = reconciler(store, providers, DuplicatePolicy.OPERATOR)
    assert recheck(store, rec, None, out.operation_id, actor="alice").outcome.endswith("clear")
    (declined,) = a.ledger()
    a.overturn(declined["id"])
    found = recheck(store, rec, "shop", out.operation_id, actor="alice")
    assert found.outcome == "the providers it left: flagged"
    assert found.record.needs_attention and not found.before.needs_attention
    assert len(money(a)) == 1 and len(money(b)) == 1 and money(a, "refund.create") == []


def test_a_stored_operation_is_answered_after_the_table_stopped_matching_it(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    providers = adapters(a.url, b.url)
    first = pay(executor(store, providers))
    euro_only = Router([Rule(operation="payment.create", providers=[B], currencies=["GBP"])])
    later = Executor(
        store=store, providers=providers, registry=default_registry(A), router=euro_only
    )
    again = pay(later)  # the same key: a replay, not "no rule matches"
    assert again.replayed and again.operation_id == first.operation_id and again.provider == A
    with pytest.raises(NoRoute):
        pay(later, "order-2")
    assert len(money(a)) == 1 and b.ledger() == []
