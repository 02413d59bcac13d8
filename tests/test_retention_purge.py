"""Retention means the data is gone; replays are counted, not logged (real databases).

A reaped operation keeps its tombstone and the shape of its audit trail, and nothing else:
the raw tables are searched for what the client and the provider sent.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import RecordingSleep

from payorch import WebhookHandler, WebhookStatus
from payorch.core import State
from payorch.errors import IdempotencyKeyExpired, IdempotencyKeyReused, OperationInProgress
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.records import NewOperation, OperationRecord
from payorch.storage._queries import stats
from payorch.storage._retention import reap
from payorch.storage._store import Store
from payorch.storage._tables import db_now_plus, events, operations, webhook_inbox

REGISTRY = default_registry("sandbox")
LEASE = timedelta(minutes=5)
EMAIL = "jane.doe.4711@example.org"  # personal data the client sent; the provider echoes it
PAYMENT = {
    "amount": 1250,
    "currency": "EUR",
    "customer": "cus_purge_42",
    "description": "order for Jane Doe",
    "metadata": {"email": EMAIL},
}
PERSONAL = (EMAIL, "cus_purge_42", "Jane Doe")


def new(key: str, **request: Any) -> NewOperation:
    return REGISTRY.prepare(
        tenant_id="t1", operation="payment.create", idempotency_key=key, request=request or PAYMENT
    ).new


def finished(store: Store, key: str) -> OperationRecord:
    op = store.claim(new(key), owner="w", lease=LEASE, possibly_sent=True).operation
    return store.transition(
        op,
        State.SUCCEEDED,
        kind="provider_answer",
        actor="w",
        provider_reference=f"eff_{key}",
        response={"status": "succeeded", "http_status": 200, "metadata": {"email": EMAIL}},
    )


def expire(store: Store, *records: OperationRecord) -> None:
    """Test setup: retention ended an hour ago (database clock), instead of sleeping."""
    with store.engine.begin() as conn:
        conn.execute(
            sa.update(operations)
            .where(operations.c.id.in_([r.id for r in records]))
            .values(retain_until=db_now_plus(sa.literal(-3600.0)))
        )


def dump(store: Store) -> str:
    """Every stored value of every table, as text: what a database dump would show."""
    with store.engine.connect() as conn:
        return "\n".join(
            repr(tuple(row))
            for table in (operations, events, webhook_inbox)
            for row in conn.execute(sa.select(table))
        )


def raw_row(store: Store, op_id: str) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(sa.select(operations).where(operations.c.id == op_id)).one()


def event_rows(store: Store, op_id: str) -> list[Any]:
    """The operation's audit trail: its event rows and the events kept on its row."""
    return list(store.events(store.find(op_id).tenant_id, op_id))


@pytest.fixture
def executor(store: Store, sandbox_provider: SandboxProvider) -> Iterator[Executor]:
    yield Executor(
        store=store,
        providers=[sandbox_provider],
        sleep=RecordingSleep(),
        registry=REGISTRY,
        lease=timedelta(seconds=30),
        owner="test-executor",
    )


# -- reaping clears every body ----------------------------------------------------------


def test_a_reaped_operation_leaves_no_personal_data_anywhere(
    store: Store, executor: Executor, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    # An answer lost after the provider committed, settled by its (signed) webhook: the
    # request, the provider's echo of it, and the delivery's body are all stored.
    sandbox.inject("drop_after")
    outcome = executor.execute(
        tenant_id="t1", operation="payment.create", idempotency_key="order-1", request=PAYMENT
    )
    assert outcome.state is State.OUTCOME_UNKNOWN
    op_id = outcome.operation_id
    (delivery,) = sandbox.webhook_deliveries()
    handler = WebhookHandler(store=store, providers=[sandbox_provider])
    applied = handler.handle("t1", "sandbox", delivery.headers, delivery.body)
    assert applied.status is WebhookStatus.APPLIED
    record = store.get("t1", op_id)
    store.append_event(  # an operator's note, as resolutions and acks carry
        record, kind="operator_note", actor="operator:alice", detail={"reason": f"mailed {EMAIL}"}
    )
    before = dump(store)
    assert all(value in before for value in PERSONAL)  # the search below can find them
    shape = [(e.kind, e.actor, e.created_at) for e in event_rows(store, op_id)]

    expire(store, record)
    report = reap(store)
    assert report.reaped == 1

    after = dump(store)
    for value in PERSONAL:
        assert value not in after
    row = raw_row(store, op_id)
    assert row.request is None and row.response is None and row.reaped_at is not None
    # The tombstone: namespace, fingerprint, final state, operation id.
    assert (row.tenant_id, row.operation, row.idempotency_key) == (
        "t1",
        "payment.create",
        "order-1",
    )
    assert (row.fingerprint, row.state, row.id) == (record.fingerprint, "succeeded", op_id)
    # The audit trail keeps its shape: kind, actor and time of every event, bodies gone.
    kept = event_rows(store, op_id)
    assert [(e.kind, e.actor, e.created_at) for e in kept[:-1]] == shape
    assert all(e.detail is None for e in kept[:-1])
    reaped = kept[-1]
    assert reaped.kind == "reaped"
    assert reaped.detail["event_details"] == len(shape)
    assert reaped.detail["webhook_bodies"] == 1
    with store.engine.connect() as conn:
        (inbox,) = conn.execute(sa.select(webhook_inbox)).all()
    assert (inbox.event_id, inbox.result, inbox.operation_id) == (
        delivery.event_id,
        "applied",
        op_id,
    )
    assert inbox.body is None
    # A retry of the key meets the tombstone; a redelivered webhook is still a duplicate.
    with pytest.raises(IdempotencyKeyExpired):
        executor.execute(
            tenant_id="t1", operation="payment.create", idempotency_key="order-1", request=PAYMENT
        )
    again = handler.handle("t1", "sandbox", delivery.headers, delivery.body)
    assert again.status is WebhookStatus.DUPLICATE
    assert len(sandbox.ledger()) == 1


def test_reaping_one_operation_leaves_the_others_bodies_alone(store: Store) -> None:
    gone, kept = finished(store, "a"), finished(store, "b")
    store.append_event(kept, kind="operator_note", actor="operator:bob", detail={"n": 1})
    details = [e.detail for e in event_rows(store, kept.id)]
    assert details[-1] == {"n": 1}
    expire(store, gone)
    assert reap(store).reaped == 1
    assert raw_row(store, kept.id).request is not None
    assert [e.detail for e in event_rows(store, kept.id)] == details


# -- a flagged operation waits for its human --------------------------------------------


def test_a_flagged_operation_is_never_reaped(store: Store) -> None:
    done = finished(store, "a")
    flagged = store.flag_attention(
        done, kind="conflicting_evidence", actor="webhook", detail={"email": EMAIL}
    )
    expire(store, flagged)
    assert reap(store, dry_run=True).items == []
    report = reap(store)
    assert (report.reaped, report.skipped) == (0, 0)
    row = raw_row(store, flagged.id)
    assert row.reaped_at is None and row.request is not None
    assert EMAIL in dump(store)  # the evidence a human needs is still there

    # Once the flag is cleared (acknowledged), the next pass reaps it.
    with store.engine.begin() as conn:
        conn.execute(
            sa.update(operations)
            .where(operations.c.id == flagged.id)
            .values(needs_attention=False, version=operations.c.version + 1)
        )
    assert reap(store).reaped == 1
    assert EMAIL not in dump(store)


def test_a_flag_raised_after_the_scan_fences_the_reap_out(store: Store) -> None:
    done = finished(store, "a")
    expire(store, done)
    listed = reap(store, dry_run=True).items
    assert [t.operation_id for t in listed] == [done.id]
    store.flag_attention(store.get("t1", done.id), kind="late_evidence", actor="w", detail={})
    assert reap(store).reaped == 0
    assert raw_row(store, done.id).reaped_at is None


# -- replays are counted on the operation ------------------------------------------------


def test_replays_increment_the_count_and_add_no_event_rows(store: Store) -> None:
    done = finished(store, "a")
    logged = len(event_rows(store, done.id))
    for _ in range(3):
        result = store.claim(new("a"), owner="client", lease=LEASE)
        assert result.replayed and result.operation.id == done.id
    row = raw_row(store, done.id)
    assert row.replays == 3 and row.last_replayed_at is not None
    # Not a change of the operation: its version (an operator's fence) stays.
    assert row.version == done.version
    assert len(event_rows(store, done.id)) == logged

    # A changed fingerprint is refused and logged (an audit fact), not counted as a replay.
    with pytest.raises(IdempotencyKeyReused):
        store.claim(new("a", **{**PAYMENT, "amount": 9999}), owner="client", lease=LEASE)
    assert raw_row(store, done.id).replays == 3
    assert [e.kind for e in event_rows(store, done.id)][-1] == "key_reused"

    counted = stats(store, window=timedelta(hours=1))
    assert (counted.replays, counted.replayed_operations, counted.conflicts) == (3, 1, 1)
    assert stats(store, window=timedelta(hours=1), tenant_id="other").replays == 0


def test_duplicates_of_unfinished_or_reaped_operations_are_not_replays(store: Store) -> None:
    live = store.claim(new("live"), owner="w", lease=LEASE).operation
    with pytest.raises(OperationInProgress):
        store.claim(new("live"), owner="client", lease=LEASE)
    assert raw_row(store, live.id).replays == 0

    done = finished(store, "old")
    expire(store, done)
    assert reap(store).reaped == 1
    with pytest.raises(IdempotencyKeyExpired):
        store.claim(new("old"), owner="client", lease=LEASE)
    assert raw_row(store, done.id).replays == 0
    assert stats(store, window=timedelta(hours=1)).replays == 0


def test_a_replay_after_waiting_is_counted_once(store: Store) -> None:
    op = store.claim(new("w"), owner="holder", lease=LEASE).operation
    results: list[Any] = []
    waiter = threading.Thread(
        target=lambda: results.append(
            store.claim(new("w"), owner="client", lease=LEASE, wait=timedelta(seconds=60))
        )
    )
    waiter.start()
    store.transition(op, State.SUCCEEDED, kind="provider_answer", actor="holder")
    waiter.join(timeout=120)
    (result,) = results
    assert result.replayed and result.operation.id == op.id
    assert raw_row(store, op.id).replays == 1
    assert [e.kind for e in event_rows(store, op.id)] == ["claimed", "provider_answer"]


def test_a_delivery_after_the_reap_keeps_no_body(
    store: Store, executor: Executor, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    outcome = executor.execute(
        tenant_id="t1", operation="payment.create", idempotency_key="late-1", request=PAYMENT
    )
    assert outcome.state is State.SUCCEEDED
    expire(store, store.get("t1", outcome.operation_id))
    assert reap(store).reaped == 1
    # The acquirer sends one more event about the same effect (a late or repeated delivery).
    (first,) = sandbox.webhook_deliveries()
    late = sandbox._acquirer.outbox.emit(json.loads(first.body)["data"])
    handler = WebhookHandler(store=store, providers=[sandbox_provider])
    result = handler.handle("t1", "sandbox", late.headers, late.body)
    assert result.operation_id == outcome.operation_id
    with store.engine.connect() as conn:
        bodies = conn.execute(
            sa.select(webhook_inbox.c.body).where(webhook_inbox.c.event_id == late.event_id)
        ).all()
    assert [row.body for row in bodies] == [None]
    assert EMAIL not in dump(store)
