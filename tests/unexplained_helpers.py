"""Payments made at the sandbox and claims lost as a failover loses them, shared by the
tests of effects no operation explains, and their ``no_key_scope`` fixture (a pytest plugin,
registered in conftest.py)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.outcome import Outcome
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._unexplained import Finding
from payorch.records import OperationRecord
from payorch.storage._store import Store
from payorch.storage._tables import events, operations

REGISTRY = default_registry("sandbox")
PAYMENT = {"amount": 4200, "currency": "EUR", "customer": "cus_7", "payment_method": "pm_visa"}
TENANT = "shop-a"


@pytest.fixture
def no_key_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installation's key scope is the environment's: none unless a test sets one."""
    monkeypatch.delenv("PAYORCH_KEY_SCOPE", raising=False)


def make_executor(
    store: Store, sandbox_provider: SandboxProvider, *, key_scope: str | None = None
) -> Executor:
    return Executor(
        store=store,
        providers=[sandbox_provider],
        registry=REGISTRY,
        lease=timedelta(seconds=30),
        owner="client-worker",
        sleep=lambda _seconds: None,  # inline retries of a refused attempt wait for nothing
        key_scope=key_scope,
    )


def pay(executor: Executor, key: str, **changes: Any) -> Outcome:
    return executor.execute(
        tenant_id=TENANT,
        operation="payment.create",
        idempotency_key=key,
        request={**PAYMENT, **changes},
    )


def lose(store: Store, operation_id: str) -> None:
    """What a failover on asynchronous replication does to a claim: its rows are gone."""
    with store.engine.begin() as conn:
        conn.execute(
            sa.delete(events).where(
                events.c.tenant_id == TENANT, events.c.operation_id == operation_id
            )
        )
        conn.execute(
            sa.delete(operations).where(
                operations.c.tenant_id == TENANT, operations.c.id == operation_id
            )
        )


def window() -> dict[str, datetime]:
    now = datetime.now(UTC)
    return {"since": now - timedelta(minutes=10), "until": now + timedelta(minutes=10)}


def by_reference(findings: list[Finding]) -> dict[str, Finding]:
    return {f.effect.provider_reference: f for f in findings}


def namespace_ops(store: Store, key: str) -> list[OperationRecord]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(operations).where(
                operations.c.tenant_id == TENANT, operations.c.idempotency_key == key
            )
        ).mappings()
        return [OperationRecord.from_row(r) for r in rows]


def post_untagged(sandbox: SandboxServer) -> str:
    """An effect someone else made at the same acquirer: no payorch metadata."""
    return post_with(sandbox, {}, key=f"other-system-{uuid.uuid4()}")


def post_with(sandbox: SandboxServer, metadata: dict[str, str], *, key: str | None = None) -> str:
    """An effect made straight at the acquirer, with this metadata (the tags it carries)."""
    reply = httpx.post(
        f"{sandbox.url}/v1/operations/payment.create",
        json={"amount": 100, "currency": "EUR", "metadata": metadata},
        headers={"Idempotency-Key": key or f"payorch:{uuid.uuid4().hex}:submit"},
    )
    assert reply.status_code == 200
    effect_id: str = reply.json()["id"]
    return effect_id
