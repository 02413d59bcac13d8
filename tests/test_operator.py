"""Operator actions on real databases: audited resolution and recheck, both lease-aware."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from payorch.core import State
from payorch.errors import (
    InvalidRequest,
    InvalidTransition,
    OperationInProgress,
    OperationNotFound,
    PayorchError,
    StaleVersion,
    UnknownProvider,
)
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider
from payorch.reconciling import _operator as operator
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.records import OperationRecord
from payorch.storage._store import Store
from payorch.storage._tables import events, operations

LIVE = timedelta(minutes=5)
REGISTRY = default_registry("sandbox")


def claim(
    store: Store,
    key: str,
    *,
    tenant: str = "t1",
    lease: timedelta = LIVE,
    possibly_sent: bool = True,
) -> OperationRecord:
    prepared = REGISTRY.prepare(
        tenant_id=tenant,
        operation="payment.create",
        idempotency_key=key,
        request={"amount": 700, "currency": "EUR", "customer": "cus_1"},
    )
    return store.claim(
        prepared.new, owner="worker-1", lease=lease, possibly_sent=possibly_sent
    ).operation


def unknown(store: Store, key: str, **kwargs: Any) -> OperationRecord:
    return store.transition(
        claim(store, key, **kwargs),
        State.OUTCOME_UNKNOWN,
        kind="provider_answer",
        actor="worker-1",
        detail={"kind": "ambiguous"},
        next_check_in=timedelta(minutes=1),
        needs_attention=True,
    )


def snapshot(store: Store) -> tuple[list[Any], int]:
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(operations).order_by(operations.c.id)).all()
        count = conn.execute(sa.select(sa.func.count()).select_from(events)).scalar_one()
    return [tuple(r) for r in rows], int(count)


def resolve(store: Store, record: OperationRecord, **kwargs: Any) -> OperationRecord:
    args: dict[str, Any] = {"to": State.SUCCEEDED, "reason": "seen at the bank", "actor": "alice"}
    args.update(kwargs)
    return operator.resolve(store, record.tenant_id, record.id, **args)


# -- resolve -----------------------------------------------------------------------------


def test_resolve_unknown_to_succeeded_with_one_audit_event(store: Store) -> None:
    op = unknown(store, "k1")
    events_before = len(store.events(op.tenant_id, op.id))
    done = resolve(store, op, provider_reference="pi_77")
    assert done.state is State.SUCCEEDED
    assert (done.resolution, done.provider_reference, done.needs_attention) == (
        "operator",
        "pi_77",
        False,
    )
    assert done.response == {
        "status": "succeeded",
        "http_status": 200,
        "provider_reference": "pi_77",
        "resolution": "operator",
    }
    assert done.retain_until is not None and done.completed_at is not None
    timeline = store.events(op.tenant_id, op.id)
    assert len(timeline) == events_before + 1
    audit = timeline[-1]
    assert (audit.kind, audit.actor, audit.from_state, audit.to_state) == (
        "operator_resolution",
        "alice",
        "outcome_unknown",
        "succeeded",
    )
    assert audit.detail is not None
    assert audit.detail["reason"] == "seen at the bank"
    assert audit.detail["provider_reference"] == "pi_77"


def test_resolve_to_failed_final_replays_a_failure(store: Store) -> None:
    done = resolve(store, unknown(store, "k1"), to=State.FAILED_FINAL, reason="no effect at PSP")
    assert done.state is State.FAILED_FINAL
    assert done.error_code == "operator_resolved"
    assert done.response is not None and done.response["http_status"] == 402


def test_resolve_an_abandoned_in_progress(store: Store) -> None:
    op = claim(store, "k1", lease=timedelta(seconds=-1), possibly_sent=False)
    done = resolve(store, op, to=State.FAILED_FINAL, reason="never sent")
    assert done.state is State.FAILED_FINAL
    assert done.lease_owner is None


def test_resolve_refuses_a_possibly_sent_in_progress_until_checked(store: Store) -> None:
    # A worker died after sending: only the provider can say what happened.
    op = claim(store, "k1", lease=timedelta(seconds=-1), possibly_sent=True)
    before = snapshot(store)
    with pytest.raises(InvalidTransition, match="recheck"):
        resolve(store, op, to=State.FAILED_FINAL, reason="looks dead")
    assert snapshot(store) == before


def test_resolve_refuses_a_live_lease(store: Store) -> None:
    live = claim(store, "k1")
    before = snapshot(store)
    with pytest.raises(OperationInProgress) as info:
        resolve(store, live)
    assert 1 <= info.value.retry_after <= LIVE.total_seconds()
    assert snapshot(store) == before


def test_resolve_refuses_an_unknown_the_reconciler_is_checking(store: Store) -> None:
    op = unknown(store, "k1")
    checking = store.transition(  # a reconciler holds the lease while it asks the provider
        op,
        State.OUTCOME_UNKNOWN,
        kind="check",
        actor="reconciler:x",
        lease=LIVE,
        lease_owner="reconciler:x",
    )
    before = snapshot(store)
    with pytest.raises(OperationInProgress, match="reconciler:x"):
        resolve(store, checking)
    assert snapshot(store) == before


def test_resolve_refuses_terminal_operations(store: Store) -> None:
    done = resolve(store, unknown(store, "k1"))
    before = snapshot(store)
    with pytest.raises(InvalidTransition, match="terminal"):
        resolve(store, done, to=State.FAILED_FINAL)
    assert snapshot(store) == before


@pytest.mark.parametrize(
    "kwargs",
    [
        {"reason": ""},
        {"reason": "   "},
        {"actor": ""},
        {"actor": "x" * 201},
        {"to": State.IN_PROGRESS},
        {"to": State.OUTCOME_UNKNOWN},
        {"provider_reference": "p" * 256},
    ],
)
def test_resolve_bad_input_writes_nothing(store: Store, kwargs: dict[str, Any]) -> None:
    op = unknown(store, "k1")
    before = snapshot(store)
    with pytest.raises(InvalidRequest):
        resolve(store, op, **kwargs)
    assert snapshot(store) == before


def test_resolve_only_the_version_the_operator_saw(store: Store) -> None:
    op = unknown(store, "k1")
    with pytest.raises(StaleVersion):
        resolve(store, op, expected_version=op.version - 1)
    assert resolve(store, op, expected_version=op.version).state is State.SUCCEEDED


def test_resolve_finds_by_id_alone_and_respects_the_tenant(store: Store) -> None:
    op = unknown(store, "k1", tenant="t2")
    with pytest.raises(OperationNotFound):
        operator.resolve(store, "t1", op.id, to=State.SUCCEEDED, reason="r", actor="a")
    done = operator.resolve(store, None, op.id, to=State.SUCCEEDED, reason="r", actor="a")
    assert done.tenant_id == "t2"


def test_concurrent_resolutions_one_wins(store: Store) -> None:
    op = unknown(store, "k1")
    barrier = threading.Barrier(8)

    def attempt(i: int) -> str:
        barrier.wait()
        try:
            target = State.SUCCEEDED if i % 2 else State.FAILED_FINAL
            resolve(store, op, to=target, actor=f"op-{i}")
            return "won"
        except PayorchError as exc:
            return type(exc).__name__

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(attempt, range(8)))
    assert results.count("won") == 1
    assert set(results) <= {"won", "StaleVersion", "InvalidTransition"}
    audit = [e for e in store.events(op.tenant_id, op.id) if e.kind == "operator_resolution"]
    assert len(audit) == 1


# -- recheck -----------------------------------------------------------------------------


def reconciler(store: Store, *providers: SandboxProvider) -> Reconciler:
    return Reconciler(
        store=store,
        providers=providers,
        policy=ReconcilerPolicy(lease=timedelta(seconds=30)),
        owner="operator:alice",
    )


def test_recheck_refuses_terminal_and_leased(
    store: Store, sandbox_provider: SandboxProvider
) -> None:
    rec = reconciler(store, sandbox_provider)
    done = resolve(store, unknown(store, "k1"))
    with pytest.raises(InvalidTransition, match="terminal"):
        operator.recheck(store, rec, done.tenant_id, done.id)
    live = claim(store, "k2")
    before = snapshot(store)
    with pytest.raises(OperationInProgress):
        operator.recheck(store, rec, live.tenant_id, live.id)
    assert snapshot(store) == before


def test_recheck_refuses_a_provider_it_cannot_ask(store: Store) -> None:
    op = unknown(store, "k1")
    before = snapshot(store)
    with pytest.raises(UnknownProvider, match="sandbox"):
        operator.recheck(store, reconciler(store), op.tenant_id, op.id)
    assert snapshot(store) == before


def test_recheck_releases_an_abandoned_attempt_without_the_provider(store: Store) -> None:
    op = claim(store, "k1", lease=timedelta(seconds=-1), possibly_sent=False)
    result = operator.recheck(store, reconciler(store), op.tenant_id, op.id, actor="alice")
    assert result.outcome == "abandoned"
    # Nothing was sent: no outcome is stored; released, the key's next request runs it again.
    after = store.get(op.tenant_id, op.id)
    assert result.record == after
    assert after.released and after.state is State.IN_PROGRESS
    assert after.lease_owner is None and not after.possibly_sent and after.response is None
    kinds = [e.kind for e in store.events(op.tenant_id, op.id)]
    assert kinds[-2:] == ["operator_recheck", "abandoned"]


def test_recheck_of_an_effect_the_provider_never_saw_stays_unknown(
    store: Store, sandbox_provider: SandboxProvider
) -> None:
    op = unknown(store, "k1")  # within the not-found grace period: wait, do not re-send
    result = operator.recheck(store, reconciler(store, sandbox_provider), op.tenant_id, op.id)
    assert result.outcome == "not_found_waiting"
    after = result.record
    assert after.state is State.OUTCOME_UNKNOWN
    assert after.checks == op.checks + 1
    assert after.lease_owner is None  # the check hands the operation back
    last = store.events(op.tenant_id, op.id)[-1]
    assert last.actor == "operator:alice" and last.kind == "status_query"
