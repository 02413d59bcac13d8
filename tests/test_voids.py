"""Void as a resolution (sandbox): the policy's deadline, the operator's `ops void`, the
refusals, and a void that races a late success. Effects are counted at the sandbox."""

from __future__ import annotations

import asyncio
import re
from datetime import timedelta
from typing import Any

import pytest
from cli_helpers import one_error_line, run
from conftest import FAST_TIMEOUT, age, effects_of, make_due

from payorch.core import State
from payorch.errors import InvalidTransition
from payorch.execution._executor import Executor
from payorch.operator import void
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.reconciling._webhooks import WebhookHandler
from payorch.storage._store import Store

AUTH = {"amount": 900, "currency": "EUR", "customer": "cus_1", "capture_method": "manual"}
CHARGE = {"amount": 900, "currency": "EUR", "customer": "cus_1"}


def reconciler(store: Store, provider: SandboxProvider, **policy: Any) -> Reconciler:
    return Reconciler(
        store=store,
        providers=[provider],
        policy=ReconcilerPolicy(lease=timedelta(seconds=30), **policy),
        owner="test-reconciler",
    )


def unknown(executor: Executor, sandbox: SandboxServer, fault: str, key: str, request: Any) -> str:
    sandbox.inject(fault)
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key=key, request=request
    )
    assert outcome.state is State.OUTCOME_UNKNOWN
    return outcome.operation_id


def statuses(sandbox: SandboxServer, store: Store, op_id: str) -> list[str]:
    return [e["status"] for e in effects_of(sandbox, store, "shop", op_id)]


def test_an_unknown_authorisation_past_its_deadline_is_voided(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    # Still processing at the provider past the deadline: no final evidence came.
    op_id = unknown(executor, sandbox, "pending", "auth-1", AUTH)
    age(store, op_id, timedelta(hours=2))
    make_due(store, op_id)
    rec = reconciler(store, sandbox_provider, void_after=timedelta(hours=1))
    report = rec.reconcile_once()
    assert report.outcomes["voided"] == 1
    record = store.get("shop", op_id)
    assert record.state is State.FAILED_FINAL and record.error_code == "voided"
    assert record.resolution == "void" and not record.needs_attention
    assert statuses(sandbox, store, op_id) == ["voided"]  # one authorisation, released
    kinds = [e.kind for e in store.events("shop", op_id)]
    assert kinds[-2:] == ["void_requested", "void"]
    # The client's retry replays the final decline: the money did not move.
    again = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key="auth-1", request=AUTH
    )
    assert again.replayed and again.state is State.FAILED_FINAL and again.error_code == "voided"


def test_without_the_policy_nothing_is_voided(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown(executor, sandbox, "pending", "auth-2", AUTH)
    age(store, op_id, timedelta(hours=2))
    make_due(store, op_id)
    report = reconciler(store, sandbox_provider).reconcile_once()
    assert report.outcomes["voided"] == 0
    assert store.get("shop", op_id).state is State.OUTCOME_UNKNOWN
    assert statuses(sandbox, store, op_id) == ["processing"]


def test_an_automatic_capture_is_never_voided_by_the_policy(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown(executor, sandbox, "pending", "charge-1", CHARGE)
    age(store, op_id, timedelta(hours=2))
    make_due(store, op_id)
    rec = reconciler(store, sandbox_provider, void_after=timedelta(hours=1))
    assert rec.reconcile_once().outcomes["voided"] == 0
    assert statuses(sandbox, store, op_id) == ["processing"]


def test_operator_void_is_audited_and_applied(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown(executor, sandbox, "drop_after", "auth-3", AUTH)
    result = void(
        store,
        reconciler(store, sandbox_provider),
        "shop",
        op_id,
        reason="customer left; release the hold",
        actor="alice",
    )
    assert result.outcome == "voided" and result.record.state is State.FAILED_FINAL
    assert statuses(sandbox, store, op_id) == ["voided"]
    requested = [e for e in store.events("shop", op_id) if e.kind == "void_requested"]
    assert len(requested) == 1 and requested[0].actor == "alice"
    assert requested[0].detail["reason"] == "customer left; release the hold"


def test_void_of_nothing_made_voids_the_key(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    # Refused before anything was done, then the lease lapsed with the attempt possibly sent.
    op_id = unknown(executor, sandbox, "error_500_before", "auth-4", AUTH)
    age(store, op_id, timedelta(minutes=5))  # past the not-found grace
    result = void(
        store, reconciler(store, sandbox_provider), "shop", op_id, reason="r", actor="bob"
    )
    assert result.outcome == "voided" and result.record.error_code == "voided"
    assert statuses(sandbox, store, op_id) == []  # nothing was ever made, and never will be


@pytest.mark.parametrize(
    ("key", "request_", "fault", "words"),
    [
        ("t-ok", AUTH, None, "terminal"),
        ("t-charge", CHARGE, "drop_after", "capture_method is not manual"),
    ],
)
def test_void_refusals_change_nothing(
    executor: Executor,
    sandbox: SandboxServer,
    store: Store,
    sandbox_provider: SandboxProvider,
    key: str,
    request_: Any,
    fault: str | None,
    words: str,
) -> None:
    if fault is not None:
        sandbox.inject(fault)
    op_id = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key=key, request=request_
    ).operation_id
    before = store.get("shop", op_id)
    with pytest.raises(InvalidTransition, match=words):
        void(store, reconciler(store, sandbox_provider), "shop", op_id, reason="r", actor="a")
    after = store.get("shop", op_id)
    assert after.version == before.version and after.state is before.state
    assert "voided" not in statuses(sandbox, store, op_id)


def test_a_late_success_after_the_void_is_flagged_not_silent(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown(executor, sandbox, "drop_after", "auth-5", AUTH)
    # The success's webhook was sent before the void, but arrives after it.
    [late] = [d for d in sandbox.webhook_deliveries() if b"effect.succeeded" in d.body]
    void(store, reconciler(store, sandbox_provider), "shop", op_id, reason="r", actor="a")
    handler = WebhookHandler(store=store, providers=[sandbox_provider])
    result = handler.handle("shop", "sandbox", late.headers, late.body)
    assert result.status.value == "conflict"
    record = store.get("shop", op_id)
    assert record.state is State.FAILED_FINAL and record.needs_attention
    # The void's own notification confirms it: recorded, not a conflict.
    [own] = [d for d in sandbox.webhook_deliveries() if b"effect.voided" in d.body]
    assert handler.handle("shop", "sandbox", own.headers, own.body).status.value == "recorded"
    assert statuses(sandbox, store, op_id) == ["voided"]


def test_ops_void_cli(
    executor: Executor, sandbox: SandboxServer, store: Store, db_url: str, monkeypatch: Any
) -> None:
    monkeypatch.setenv("PAYORCH_SANDBOX_URL", sandbox.url)
    op_id = unknown(executor, sandbox, "drop_after", "auth-6", AUTH)
    done = run(db_url, "ops", "void", op_id, "--reason", "hold too long", "--actor", "carol")
    assert done.exit_code == 0, done.output
    assert "-> failed_final (void: voided)" in done.stdout
    assert statuses(sandbox, store, op_id) == ["voided"]
    shown = run(db_url, "ops", "show", op_id)
    assert re.search(r"resolution\W+void\b", shown.stdout), shown.stdout  # the path that settled it
    assert re.search(r"error code\W+voided\b", shown.stdout), shown.stdout
    # Again: it is terminal now; refused with the reason, one line, non-zero.
    refused = run(db_url, "ops", "void", op_id, "--reason", "again", "--actor", "carol")
    assert refused.exit_code != 0
    assert "terminal" in one_error_line(refused)


def test_the_async_reconciler_voids_through_the_adapters_coroutine(
    db_url: str, sandbox: SandboxServer, store: Store
) -> None:
    from payorch import AsyncExecutor, AsyncReconciler, AsyncStore

    async def main() -> tuple[str, Any]:
        async_store = AsyncStore.from_url(db_url)
        try:
            async with SandboxProvider(base_url=sandbox.url, timeout=FAST_TIMEOUT) as provider:
                ex = AsyncExecutor(
                    store=async_store, providers=[provider], lease=timedelta(seconds=30)
                )
                sandbox.inject("pending")
                outcome = await ex.execute(
                    tenant_id="shop",
                    operation="payment.create",
                    idempotency_key="async-auth-1",
                    request=AUTH,
                    provider="sandbox",
                )
                await asyncio.to_thread(age, store, outcome.operation_id, timedelta(hours=2))
                await asyncio.to_thread(make_due, store, outcome.operation_id)
                rec = AsyncReconciler(
                    store=async_store,
                    providers=[provider],
                    policy=ReconcilerPolicy(
                        lease=timedelta(seconds=30), void_after=timedelta(hours=1)
                    ),
                )
                report = await rec.reconcile_once()
                return outcome.operation_id, report.outcomes
        finally:
            await async_store.close()

    op_id, outcomes = asyncio.run(main())
    assert outcomes["voided"] == 1
    assert store.get("shop", op_id).error_code == "voided"
    assert statuses(sandbox, store, op_id) == ["voided"]
