"""The HTTP answers offered to the embedding app, end to end through execute()."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import RecordingSleep, make_due

from payorch.errors import IdempotencyKeyExpired, IdempotencyKeyReused, OperationInProgress
from payorch.execution._executor import Executor
from payorch.http import http_answer
from payorch.operations import OperationType, PaymentCreate, default_registry
from payorch.outcome import Outcome
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.storage import _retention as retention
from payorch.storage._store import Store
from payorch.storage._tables import operations

PAYMENT = {"amount": 990, "currency": "EUR", "customer": "cus_3"}


def pay(
    executor: Executor, key: str = "order-1", operation: str = "payment.create", **req: object
) -> Outcome:
    return executor.execute(
        tenant_id="shop", operation=operation, idempotency_key=key, request={**PAYMENT, **req}
    )


def test_success_and_its_replay(executor: Executor) -> None:
    first = http_answer(pay(executor))
    again = http_answer(pay(executor))
    assert (first.status, again.status) == (200, 200)
    assert "Idempotent-Replayed" not in first.headers
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.body == first.body and first.body["state"] == "succeeded"
    assert first.body["provider_reference"].startswith("sbx_")


def test_decline_unknown_and_reuse(executor: Executor, sandbox: SandboxServer) -> None:
    declined = http_answer(pay(executor, "d", payment_method="pm_card_declined"))
    assert declined.status == 402 and declined.body["code"] == "generic_decline"
    sandbox.inject("drop_after")
    unknown = http_answer(pay(executor, "u"))
    assert unknown.status == 202 and unknown.body["state"] == "outcome_unknown"
    assert unknown.headers["Payorch-Operation-Id"] == unknown.body["operation_id"]
    with pytest.raises(IdempotencyKeyReused) as info:
        pay(executor, "u", amount=991)
    assert http_answer(info.value).status == 422
    # At the provider: the decline and the dropped-but-committed payment, nothing more.
    assert sorted(e["status"] for e in sandbox.ledger()) == ["declined", "succeeded"]


def test_in_progress_says_when_to_come_back(store: Store, executor: Executor) -> None:
    new = (
        default_registry("sandbox")
        .prepare(
            tenant_id="shop", operation="payment.create", idempotency_key="busy", request=PAYMENT
        )
        .new
    )
    store.claim(new, owner="someone", lease=timedelta(seconds=30))
    with pytest.raises(OperationInProgress) as info:
        pay(executor, "busy")
    answer = http_answer(info.value)
    assert answer.status == 409
    assert 1 <= int(answer.headers["Retry-After"]) <= 30


@pytest.mark.parametrize(
    ("expired_status", "operation"), [(410, "payment.create"), (422, "legacy.charge")]
)
def test_a_reaped_key_answers_its_configured_status(
    store: Store,
    sandbox: SandboxServer,
    sandbox_provider: SandboxProvider,
    expired_status: int,
    operation: str,
) -> None:
    registry = default_registry("sandbox")
    registry.register(
        OperationType(
            name="legacy.charge",
            model=PaymentCreate,
            effect_fields=("amount", "currency", "customer"),
            provider="sandbox",
            expired_status=422,
        )
    )
    ex = Executor(
        store=store, providers=[sandbox_provider], registry=registry, sleep=RecordingSleep()
    )
    first = pay(ex, "old", operation=operation)
    with store.engine.begin() as conn:  # time passes beyond the retention window
        conn.execute(
            sa.update(operations)
            .where(operations.c.id == first.operation_id)
            .values(retain_until=datetime.now(UTC) - timedelta(days=1))
        )
    assert len(retention.reap(store).items) == 1
    with pytest.raises(IdempotencyKeyExpired) as info:
        pay(ex, "old", operation=operation)
    assert http_answer(info.value).status == expired_status
    assert len(sandbox.ledger()) == 1


def test_taken_over_mid_call_answers_409_with_retry_after(
    store: Store, sandbox: SandboxServer
) -> None:
    class TakenOver(SandboxProvider):
        """Our lease lapses mid-call and the reconciler leases the operation."""

        def submit(self, request: Any) -> Any:
            answer = super().submit(request)
            make_due(store, request.operation_id)
            current = store.get(request.tenant_id, request.operation_id)
            store.lease_one(
                current,
                owner="reconciler",
                lease=timedelta(seconds=30),
                kind="test_takeover",
                actor="reconciler",
                detail={},
            )
            return answer

    with TakenOver(base_url=sandbox.url) as slow:
        ex = Executor(
            store=store,
            providers=[slow],
            registry=default_registry("sandbox"),
            sleep=RecordingSleep(),
        )
        answer = http_answer(pay(ex, "late"))
    assert answer.status == 409 and answer.headers["Retry-After"] == "1"
    assert answer.body["state"] == "in_progress"
