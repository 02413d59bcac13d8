"""Routing at its edges: answers that look like proof and are not, a failover that loses a
routed claim, a flag that must outlive the settling of its operation, an operator's void,
many moves at once, and a routing table that says nonsense. Effects counted at both
acquirers in every test."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from conftest import FAST_TIMEOUT, make_due
from routing_helpers import (
    OPEN,
    A,
    B,
    adapters,
    executor,
    lost_then_routed_past_a,
    money,
    pay,
    reconciler,
    sample,
)

from payorch.core import State
from payorch.errors import ConfigurationError
from payorch.operator import void as operator_void
from payorch.provider import Answer, AnswerKind, SubmitRequest, VoidRequest
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._crossings import CROSS_DUPLICATE, DuplicatePolicy
from payorch.reconciling._fallback_watch import FallbackWatch
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.reconciling._unexplained import scan
from payorch.routing import Router, Rule, attempts_of, router_from_mapping
from payorch.storage._store import Store


class InFlight(SandboxProvider):
    """An acquirer saying "a request under your key is being processed" (409): this
    request did nothing, yet the key may be charging there right now."""

    def submit(self, request: SubmitRequest) -> Answer:
        return Answer(kind=AnswerKind.NOT_SENT, status_code=409, code="request_in_progress")


def test_a_key_in_use_at_the_first_acquirer_is_no_proof_to_move_on(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    busy = InFlight(base_url=a.url, name=A, timeout=FAST_TIMEOUT)
    OPEN.append(busy)
    routed = executor(store, [busy, adapters(a.url, b.url)[1]])
    out = pay(routed)
    # Retried at A, still in use there: possibly charging under A's key, so it stays with A
    # as unknown (the reconciler asks A), never released for a later call to move on.
    assert out.state is State.OUTCOME_UNKNOWN and out.provider == A
    assert pay(routed).operation_id == out.operation_id  # the retry: the unknown as it stands
    record = store.get("shop", out.operation_id)
    assert [s["provider"] for s in attempts_of(record.route)] == [A] and record.possibly_sent
    assert b.ledger() == [] and a.ledger() == []


def test_a_lost_claim_routed_again_elsewhere_is_found_as_a_second_effect(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    providers = adapters(a.url, b.url)
    # Meanwhile A looks unhealthy here: the retry of the same key is routed to B first.
    _, retry = lost_then_routed_past_a(store, providers)
    assert len(money(a)) == 1 and len(money(b)) == 1  # the double fault charged twice
    # The look for effects no operation explains names it, with both operations' story.
    report = scan(store, providers[0], since=_since(), until=_until())
    (finding,) = report.findings
    assert finding.operation_id == retry.operation_id and not finding.adoptable
    assert finding.refusal is not None and "cross-provider duplicate" in finding.refusal
    # ... and so does the daemon's look: the route noted the provider it passed over.
    rec = reconciler(store, providers, DuplicatePolicy.OPERATOR)
    watch = FallbackWatch(store=store, crossings=rec.crossings, ages=(timedelta(0),))
    assert watch.run() == {"flagged": 1}
    assert store.get("shop", retry.operation_id).needs_attention


def _since() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC) - timedelta(minutes=5)


def _until() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC) + timedelta(minutes=5)


def test_the_flag_outlives_the_settling_of_the_operation(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    providers = adapters(a.url, b.url)
    a.inject("decline")
    b.inject("pending")  # B holds it: the operation is unknown a while
    out = pay(executor(store, providers, declines=("generic_decline",)))
    assert out.provider == B and out.state is State.OUTCOME_UNKNOWN
    (declined,) = a.ledger()
    a.overturn(declined["id"])
    # Listed at A before any look: a late effect at a provider the operation left.
    (late,) = scan(store, providers[0], since=_since(), until=_until()).findings
    assert late.refusal is not None and "cross-provider duplicate" in late.refusal
    rec = reconciler(store, providers, DuplicatePolicy.REVERSE)
    counted = sample("payorch_route_cross_provider_duplicates_total", provider=A)
    assert rec.check_crossings(store.get("shop", out.operation_id)) == ["flagged"]
    (held,) = b.ledger()
    b.settle(held["id"])
    make_due(store, out.operation_id)
    rec.run_until_idle()  # settles it at B, the flag kept; then asks A again
    done = store.get("shop", out.operation_id)
    assert done.state is State.SUCCEEDED and done.needs_attention
    kinds = [e.kind for e in store.events("shop", out.operation_id)]
    assert kinds.count(CROSS_DUPLICATE) == 1 and "cross_provider_reversal" in kinds
    # One duplicate, counted once, however often its flag is raised.
    assert sample("payorch_route_cross_provider_duplicates_total", provider=A) == counted + 1
    assert len(money(a)) == 1 and len(money(a, "refund.create")) == 1 and len(money(b)) == 1


class VoidUnsure(SandboxProvider):
    """An adapter whose first void gets no clear answer."""

    voids = 0

    def void(self, request: VoidRequest) -> Answer:
        VoidUnsure.voids += 1
        if VoidUnsure.voids == 1:
            return Answer(kind=AnswerKind.AMBIGUOUS, code="reset")
        return super().void(request)


def held_at_a(
    store: Store, a: SandboxServer, b_url: str, *, void_after: timedelta | None
) -> tuple[Any, Reconciler]:
    """A routed manual-capture payment held (pending) at A, whose first void there gets no
    clear answer; and a reconciler with both acquirers."""
    VoidUnsure.voids = 0
    unsure = VoidUnsure(base_url=a.url, name=A, timeout=FAST_TIMEOUT)
    OPEN.append(unsure)
    providers = [unsure, adapters(a.url, b_url)[1]]
    policy = ReconcilerPolicy(void_after=void_after, not_found_grace=timedelta(0))
    rec = Reconciler(store=store, providers=providers, policy=policy, owner="reconciler-test")
    a.inject("pending")
    return pay(executor(store, providers), capture_method="manual"), rec


def test_an_operators_void_never_moves_the_operation_on_even_when_sent_again(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    out, rec = held_at_a(store, a, b.url, void_after=None)
    operator_void(store, rec, "shop", out.operation_id, reason="customer left", actor="alice")
    make_due(store, out.operation_id)
    rec.run_until_idle()  # the void again, by the reconciler: the operator's still
    done = store.get("shop", out.operation_id)
    assert done.state is State.FAILED_FINAL and done.provider == A
    assert [e["status"] for e in a.ledger()] == ["voided"] and b.ledger() == []


def test_an_operators_void_over_the_policys_in_flight_one_settles_it_there(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    out, rec = held_at_a(store, a, b.url, void_after=timedelta(0))
    make_due(store, out.operation_id)
    rec.run_until_idle(max_passes=1)  # the policy's void: no clear answer, still in flight
    assert store.get("shop", out.operation_id).resolution == "void_requested"
    operator_void(store, rec, "shop", out.operation_id, reason="release it", actor="alice")
    done = store.get("shop", out.operation_id)
    assert done.state is State.FAILED_FINAL and done.provider == A
    assert [e["status"] for e in a.ledger()] == ["voided"] and b.ledger() == []


def test_a_burst_of_moves_is_looked_at_whole(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    a, b = acquirers
    a.stop()
    providers = adapters(a.url, b.url)
    ex = executor(store, providers)
    ids = {pay(ex, f"burst-{i}").operation_id for i in range(5)}
    rec = reconciler(store, providers, DuplicatePolicy.OPERATOR)
    watch = FallbackWatch(store=store, crossings=rec.crossings, ages=(timedelta(0),), page=2)
    assert watch.moved_between(_since(), _until()) == {("shop", i) for i in ids}
    assert watch.run() == {"clear": 5}
    assert len(money(b)) == 5 and a.ledger() == []


def test_not_found_past_the_window_then_a_rate_limit_still_reaches_the_next_provider(
    store: Store, acquirers: tuple[SandboxServer, SandboxServer]
) -> None:
    from conftest import age

    a, b = acquirers
    providers = adapters(a.url, b.url)
    a.inject("error_500_before")
    out = pay(executor(store, providers))
    age(store, out.operation_id, timedelta(hours=25))
    make_due(store, out.operation_id)
    b.inject("rate_limit")  # the move's first send at B does nothing
    rec = reconciler(store, providers, DuplicatePolicy.REVERSE)
    rec.run_until_idle(max_passes=1)
    moved = store.get("shop", out.operation_id)
    assert moved.provider == B and moved.state is State.OUTCOME_UNKNOWN and b.ledger() == []
    make_due(store, out.operation_id)
    rec.run_until_idle()  # B's key is minutes old, not A's 25 hours: re-sent there
    done = store.get("shop", out.operation_id)
    assert done.state is State.SUCCEEDED and done.provider == B and not done.needs_attention
    assert a.ledger() == [] and len(money(b)) == 1


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ({"health": {"cool_off_seconds": float("nan")}}, "health.cool_off_seconds"),
        ({"health": {"window_seconds": 1e300}}, "health.window_seconds"),
        ({"health": {"min_calls": 0}}, "health.min_calls"),
    ],
)
def test_a_health_setting_that_cannot_be_is_refused_in_one_line(
    table: dict[str, Any], says: str
) -> None:
    rules = [{"operation": "payment.create", "providers": ["a"]}]
    with pytest.raises(ConfigurationError) as caught:
        router_from_mapping({"rules": rules, **table})
    assert says in caught.value.message and "\n" not in caught.value.message


@pytest.mark.parametrize(
    ("rule", "says"),
    [
        ({"tenants": "shop-9"}, "tenants must be a list of strings"),
        ({"currencies": "EUR"}, "currencies must be a list of strings"),
        ({"operation": "payment.creat"}, "which is not registered"),
        ({"max_amount": 10.5}, "max_amount must be an integer"),
    ],
)
def test_a_rule_of_the_wrong_shape_is_refused_at_start_up(
    rule: dict[str, Any], says: str, store: Store
) -> None:
    from payorch.execution._executor import Executor
    from payorch.operations import default_registry

    made = adapters("http://127.0.0.1:1", "http://127.0.0.1:1")
    routed = Rule(**{"operation": "payment.create", "providers": [A, B], **rule})
    with pytest.raises(ConfigurationError) as caught:
        Executor(store=store, providers=made, registry=default_registry(A), router=Router([routed]))
    assert says in caught.value.message and "\n" not in caught.value.message


def test_the_async_executor_routes_as_the_sync_one_does(
    db_url: str, acquirers: tuple[SandboxServer, SandboxServer], loop_thread: Any
) -> None:
    from payorch.execution._async import AsyncExecutor
    from payorch.operations import default_registry
    from payorch.storage._async_store import AsyncStore

    a, b = acquirers
    a.stop()
    providers = adapters(a.url, b.url)
    astore = AsyncStore.from_url(db_url)
    try:
        ex = AsyncExecutor(
            store=astore,
            providers=providers,
            registry=default_registry(A),
            router=Router([Rule(operation="payment.create", providers=[A, B])], health=None),
        )
        out = loop_thread.run(
            ex.execute(
                tenant_id="shop",
                operation="payment.create",
                idempotency_key="async-1",
                request={"amount": 990, "currency": "EUR"},
            )
        )
    finally:
        for provider in providers:
            loop_thread.run(provider.aclose())
        loop_thread.run(astore.close())
    assert out.state is State.SUCCEEDED and out.provider == B and out.routed
    assert len(money(b)) == 1 and a.ledger() == []
