"""Webhooks: verified, deduplicated by event id, applied as evidence; conflicts flagged."""

from __future__ import annotations

import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from standardwebhooks.webhooks import Webhook

from payorch import WebhookHandler, WebhookStatus
from payorch.core import State
from payorch.errors import WebhookMalformed, WebhookSignatureInvalid
from payorch.execution._executor import Executor
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.storage._store import Store
from payorch.storage._tables import webhook_inbox

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}


def unknown(executor: Executor, sandbox: SandboxServer, key: str = "k1") -> str:
    sandbox.inject("drop_after")
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key=key, request=PAYMENT
    )
    assert outcome.state is State.OUTCOME_UNKNOWN
    return outcome.operation_id


def signed(
    secret: str, event: dict[str, Any], *, at: datetime | None = None
) -> tuple[dict[str, str], bytes]:
    body = json.dumps(event)
    when = at or datetime.now(UTC)
    headers = {
        "webhook-id": event["id"],
        "webhook-timestamp": str(int(when.timestamp())),
        "webhook-signature": Webhook(secret).sign(event["id"], when, body),
    }
    return headers, body.encode()


def inbox(store: Store) -> list[tuple[str, str]]:
    with store.engine.connect() as conn:
        return [
            (r.event_id, r.result)
            for r in conn.execute(sa.select(webhook_inbox).order_by(webhook_inbox.c.received_at))
        ]


@pytest.fixture
def handler(store: Store, sandbox_provider: SandboxProvider) -> WebhookHandler:
    return WebhookHandler(store=store, providers=[sandbox_provider])


def test_webhook_resolves_an_unknown_operation(
    executor: Executor, sandbox: SandboxServer, store: Store, handler: WebhookHandler
) -> None:
    op_id = unknown(executor, sandbox)
    (delivery,) = sandbox.webhook_deliveries()
    result = handler.handle("shop", "sandbox", delivery.headers, delivery.body)
    assert result.status is WebhookStatus.APPLIED and result.operation_id == op_id
    record = store.get("shop", op_id)
    assert record.state is State.SUCCEEDED and record.resolution == "webhook"
    assert record.provider_reference is not None
    assert inbox(store) == [(delivery.event_id, "applied")]


def test_the_same_webhook_five_times_is_one_transition(
    executor: Executor, sandbox: SandboxServer, store: Store, handler: WebhookHandler
) -> None:
    op_id = unknown(executor, sandbox)
    (delivery,) = sandbox.webhook_deliveries()
    results = [handler.handle("shop", "sandbox", delivery.headers, delivery.body) for _ in range(5)]
    assert [r.status for r in results] == [WebhookStatus.APPLIED] + [WebhookStatus.DUPLICATE] * 4
    transitions = [e for e in store.events("shop", op_id) if e.kind == "webhook"]
    assert len(transitions) == 1
    assert len(inbox(store)) == 1


def test_out_of_order_contradiction_is_flagged_never_applied(
    executor: Executor, sandbox: SandboxServer, store: Store, handler: WebhookHandler
) -> None:
    op_id = unknown(executor, sandbox)
    (delivery,) = sandbox.webhook_deliveries()
    succeeded_event = json.loads(delivery.body)
    failed_event = {
        **succeeded_event,
        "id": "evt_late_failure",
        "type": "effect.declined",
        "data": {**succeeded_event["data"], "status": "declined"},
    }
    headers, body = signed(sandbox.webhook_secret, failed_event)
    # The failure arrives first and is applied; the success then contradicts it.
    first = handler.handle("shop", "sandbox", headers, body)
    second = handler.handle("shop", "sandbox", delivery.headers, delivery.body)
    assert first.status is WebhookStatus.APPLIED and first.state is State.FAILED_FINAL
    assert second.status is WebhookStatus.CONFLICT
    record = store.get("shop", op_id)
    assert record.state is State.FAILED_FINAL and record.needs_attention
    kinds = [e.kind for e in store.events("shop", op_id)]
    assert kinds.count("webhook") == 1 and kinds[-1] == "conflicting_evidence"
    assert dict(inbox(store)) == {"evt_late_failure": "applied", delivery.event_id: "conflict"}


def test_agreeing_webhook_after_resolution_is_recorded_only(
    executor: Executor, sandbox: SandboxServer, store: Store, handler: WebhookHandler
) -> None:
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key="ok", request=PAYMENT
    )
    (delivery,) = sandbox.webhook_deliveries()
    result = handler.handle("shop", "sandbox", delivery.headers, delivery.body)
    assert result.status is WebhookStatus.RECORDED
    record = store.get("shop", outcome.operation_id)
    assert record.state is State.SUCCEEDED and not record.needs_attention


@pytest.mark.parametrize("tamper", ["body", "signature", "missing", "stale"])
def test_bad_signatures_are_rejected_and_change_nothing(
    executor: Executor, sandbox: SandboxServer, store: Store, handler: WebhookHandler, tamper: str
) -> None:
    op_id = unknown(executor, sandbox)
    (delivery,) = sandbox.webhook_deliveries()
    headers, body = dict(delivery.headers), delivery.body
    if tamper == "body":
        body = body.replace(b"succeeded", b"declined")
    elif tamper == "signature":
        headers["webhook-signature"] = "v1," + "A" * 44
    elif tamper == "missing":
        del headers["webhook-signature"]
    else:
        headers, body = signed(
            sandbox.webhook_secret,
            json.loads(delivery.body),
            at=datetime.now(UTC) - timedelta(hours=1),
        )
    with pytest.raises(WebhookSignatureInvalid) as info:
        handler.handle("shop", "sandbox", headers, body)
    assert info.value.http_status == 400
    assert store.get("shop", op_id).state is State.OUTCOME_UNKNOWN
    assert inbox(store) == []


def test_malformed_json_with_a_valid_signature_is_rejected(
    sandbox: SandboxServer, store: Store, handler: WebhookHandler
) -> None:
    when = datetime.now(UTC)
    body = "{not json"
    headers = {
        "webhook-id": "evt_x",
        "webhook-timestamp": str(int(when.timestamp())),
        "webhook-signature": Webhook(sandbox.webhook_secret).sign("evt_x", when, body),
    }
    with pytest.raises(WebhookMalformed):
        handler.handle("shop", "sandbox", headers, body.encode())
    assert inbox(store) == []


def test_unknown_event_type_is_ignored_and_unknown_operation_kept_for_review(
    executor: Executor, sandbox: SandboxServer, store: Store, handler: WebhookHandler
) -> None:
    op_id = unknown(executor, sandbox)
    (delivery,) = sandbox.webhook_deliveries()
    event = json.loads(delivery.body)
    odd = {**event, "id": "evt_odd", "type": "effect.archived"}
    result = handler.handle("shop", "sandbox", *signed(sandbox.webhook_secret, odd))
    assert result.status is WebhookStatus.IGNORED
    stranger = {
        **event,
        "id": "evt_stranger",
        "data": {
            **event["data"],
            "id": "sbx_nobody",
            "idempotency_key": "someone-else",
            "metadata": {},
        },
    }
    result = handler.handle("shop", "sandbox", *signed(sandbox.webhook_secret, stranger))
    assert result.status is WebhookStatus.UNMATCHED and result.http_status == 200
    assert store.get("shop", op_id).state is State.OUTCOME_UNKNOWN
    assert dict(inbox(store)) == {"evt_odd": "ignored", "evt_stranger": "unmatched"}


def test_webhook_for_another_tenant_does_not_touch_this_one(
    executor: Executor, sandbox: SandboxServer, store: Store, handler: WebhookHandler
) -> None:
    op_id = unknown(executor, sandbox)
    (delivery,) = sandbox.webhook_deliveries()
    result = handler.handle("other-shop", "sandbox", delivery.headers, delivery.body)
    assert result.status is WebhookStatus.UNMATCHED
    assert store.get("shop", op_id).state is State.OUTCOME_UNKNOWN


def test_concurrent_deliveries_of_one_event_take_effect_once(
    executor: Executor, sandbox: SandboxServer, store: Store, handler: WebhookHandler
) -> None:
    op_id = unknown(executor, sandbox)
    (delivery,) = sandbox.webhook_deliveries()
    barrier = threading.Barrier(8)

    def deliver(_: int) -> WebhookStatus:
        barrier.wait()
        return handler.handle("shop", "sandbox", delivery.headers, delivery.body).status

    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = Counter(pool.map(deliver, range(8)))
    assert statuses == Counter({WebhookStatus.APPLIED: 1, WebhookStatus.DUPLICATE: 7})
    kinds = [e.kind for e in store.events("shop", op_id)]
    assert kinds.count("webhook") == 1 and "webhook_evidence" not in kinds
    assert inbox(store) == [(delivery.event_id, "applied")]
