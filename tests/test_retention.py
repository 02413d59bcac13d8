"""Retention on real databases: tombstones, dry runs, batches, and replay after reaping."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from payorch.cli._app import app
from payorch.core import State
from payorch.errors import IdempotencyKeyExpired
from payorch.execution._executor import Executor
from payorch.operations import MONEY_RETENTION, default_registry
from payorch.providers.sandbox import SandboxServer
from payorch.records import OperationRecord
from payorch.storage._retention import reap
from payorch.storage._store import Store
from payorch.storage._tables import db_now_plus, events, operations

REGISTRY = default_registry("sandbox")
LEASE = timedelta(minutes=5)
PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}


def finished(
    store: Store, key: str, *, tenant: str = "t1", state: State = State.SUCCEEDED
) -> OperationRecord:
    prepared = REGISTRY.prepare(
        tenant_id=tenant, operation="payment.create", idempotency_key=key, request=PAYMENT
    )
    op = store.claim(prepared.new, owner="w", lease=LEASE, possibly_sent=True).operation
    return store.transition(
        op,
        state,
        kind="provider_answer",
        actor="w",
        provider_reference=f"eff_{key}",
        response={"status": state.value, "http_status": 200, "card": "4242"},
    )


def expire(store: Store, *records: OperationRecord) -> None:
    """Test setup: move retention an hour into the past (database clock) instead of sleeping."""
    with store.engine.begin() as conn:
        conn.execute(
            sa.update(operations)
            .where(operations.c.id.in_([r.id for r in records]))
            .values(retain_until=db_now_plus(sa.literal(-3600.0)))
        )


def snapshot(store: Store) -> tuple[list[Any], int]:
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(operations).order_by(operations.c.id)).all()
        count = conn.execute(sa.select(sa.func.count()).select_from(events)).scalar_one()
    return [tuple(r) for r in rows], int(count)


def test_reap_leaves_a_tombstone_and_an_event(store: Store) -> None:
    due_ok = finished(store, "a")
    due_failed = finished(store, "b", state=State.FAILED_FINAL)
    kept = finished(store, "c")  # terminal, retention not over
    active = store.claim(
        REGISTRY.prepare(
            tenant_id="t1", operation="payment.create", idempotency_key="d", request=PAYMENT
        ).new,
        owner="w",
        lease=LEASE,
    ).operation
    expire(store, due_ok, due_failed)
    assert kept.retain_until is not None and kept.completed_at is not None
    assert kept.retain_until - kept.completed_at == pytest.approx(
        MONEY_RETENTION, abs=timedelta(seconds=1)
    )

    report = reap(store)
    assert report.reaped == 2 and report.skipped == 0
    assert {t.operation_id for t in report.items} == {due_ok.id, due_failed.id}
    for before in (due_ok, due_failed):
        after = store.get(before.tenant_id, before.id)
        assert after.request is None and after.response is None
        assert after.reaped_at is not None
        assert after.version == before.version + 1
        # The tombstone: namespace, fingerprint, final state, operation id.
        assert (after.idempotency_key, after.fingerprint, after.state, after.id) == (
            before.idempotency_key,
            before.fingerprint,
            before.state,
            before.id,
        )
        reaped = [e for e in store.events(after.tenant_id, after.id) if e.kind == "reaped"]
        assert len(reaped) == 1 and reaped[0].detail is not None
        assert reaped[0].detail["stripped"] == [
            "request",
            "response",
            "event_details",
            "webhook_bodies",
        ]
    for untouched in (kept, active):
        assert store.get(untouched.tenant_id, untouched.id) == untouched
    assert reap(store).reaped == 0  # nothing left to do


def test_dry_run_lists_and_writes_nothing(store: Store) -> None:
    ops = [finished(store, k) for k in ("a", "b", "c")]
    expire(store, *ops[:2])
    before = snapshot(store)
    report = reap(store, dry_run=True)
    assert report.dry_run and report.reaped == 0
    assert {t.operation_id for t in report.items} == {ops[0].id, ops[1].id}
    assert snapshot(store) == before


def test_bounded_batches_across_tenants(store: Store) -> None:
    ops = [finished(store, f"k{i}", tenant=f"tenant-{i % 3}") for i in range(7)]
    expire(store, *ops)
    first = reap(store, limit=4, batch_size=2)
    assert first.reaped == 4
    dry = reap(store, dry_run=True)
    assert len(dry.items) == 3
    rest = reap(store, batch_size=2)
    assert rest.reaped == 3
    assert {t.operation_id for t in first.items + rest.items} == {o.id for o in ops}
    assert reap(store, tenant_id="tenant-1").reaped == 0


def test_replay_after_reaping_is_expired_and_nothing_runs(
    store: Store, executor: Executor, sandbox: SandboxServer
) -> None:
    def pay() -> Any:
        return executor.execute(
            tenant_id="t1", operation="payment.create", idempotency_key="order-1", request=PAYMENT
        )

    first = pay()
    assert first.succeeded and not first.replayed
    assert pay().replayed  # within retention: the first outcome
    assert len(sandbox.ledger()) == 1
    expire(store, store.get("t1", first.operation_id))
    assert reap(store).reaped == 1

    with pytest.raises(IdempotencyKeyExpired) as info:
        pay()
    assert info.value.operation_id == first.operation_id
    assert info.value.http_status == 410
    assert len(sandbox.ledger()) == 1  # no new effect at the provider
    with pytest.raises(IdempotencyKeyExpired):  # a changed amount: still the tombstone
        executor.execute(
            tenant_id="t1",
            operation="payment.create",
            idempotency_key="order-1",
            request={**PAYMENT, "amount": 9999},
        )
    assert len(sandbox.ledger()) == 1


def test_keys_reap_command(db_url: str, store: Store) -> None:
    ops = [finished(store, k) for k in ("a", "b")]
    expire(store, ops[0])
    runner = CliRunner()
    before = snapshot(store)
    dry = runner.invoke(app, ["keys", "reap", "--dry-run", "--json", "--database-url", db_url])
    assert dry.exit_code == 0, dry.output
    listed = json.loads(dry.stdout)
    assert (listed["dry_run"], listed["due"], listed["reaped"]) == (True, 1, 0)
    assert listed["items"][0]["operation_id"] == ops[0].id
    assert listed["items"][0]["fingerprint"] == ops[0].fingerprint
    assert snapshot(store) == before
    table = runner.invoke(app, ["keys", "reap", "--dry-run", "--database-url", db_url])
    assert "would become tombstones" in table.stdout and ops[0].id in table.stdout

    done = runner.invoke(app, ["keys", "reap", "--database-url", db_url])
    assert done.exit_code == 0, done.output
    assert "reaped 1 namespaces" in done.stdout
    assert store.get("t1", ops[0].id).reaped_at is not None
    assert store.get("t1", ops[1].id).reaped_at is None
    bad = runner.invoke(app, ["keys", "reap", "--limit", "0", "--database-url", db_url])
    assert bad.exit_code == 2
