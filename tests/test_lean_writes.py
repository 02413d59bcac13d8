"""What an operation's writes leave behind, now that the happy path writes only its row.

An uneventful payment (claimed, answered terminally) writes no event row: its two events are
kept on the operation's row and told by ``Store.events()`` as before. The records the store
hands back after a claim or a write are built from what it sent and what the database
stamped: each must equal a fresh read. A write out of ``in_progress`` sends a NOTIFY only for
an operation someone waits on.
"""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
import sqlalchemy as sa

from payorch.core import State
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.records import NewOperation
from payorch.storage._store import Store
from payorch.storage._tables import events
from payorch.storage._waiting import NOTIFY_CHANNEL

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_1", "metadata": {"order": "o-1"}}
LEASE = timedelta(seconds=30)
MONEY = ("succeeded", "captured")


def new(key: str, tenant: str = "shop") -> NewOperation:
    return NewOperation(
        tenant_id=tenant,
        operation="payment.create",
        idempotency_key=key,
        fingerprint="f" * 64,
        provider="sandbox",
        request=PAYMENT,
        amount=1250,
        currency="EUR",
    )


def event_rows(store: Store, op_id: str) -> int:
    with store.engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count()).select_from(events).where(events.c.operation_id == op_id)
            ).scalar_one()
        )


def effects(sandbox: SandboxServer, store: Store, tenant: str, op_id: str) -> int:
    key = store.get(tenant, op_id).downstream_key
    return len([e for e in sandbox.effects_for(key) if e["status"] in MONEY])


@pytest.fixture
def executor(store: Store, sandbox_provider: SandboxProvider) -> Executor:
    return Executor(
        store=store,
        providers=[sandbox_provider],
        registry=default_registry("sandbox"),
        lease=LEASE,
        owner="exec-1",
    )


def test_the_records_a_claim_and_its_writes_hand_back_equal_a_fresh_read(store: Store) -> None:
    claimed = store.claim(new("k1"), owner="exec-1", lease=LEASE)
    assert claimed.created
    assert claimed.operation == store.get("shop", claimed.operation.id)
    # A retry that keeps the lease, then the unknown outcome with its next check, then the
    # terminal answer: each record as the row reads back.
    renewed = store.transition(
        claimed.operation,
        State.IN_PROGRESS,
        kind="attempt",
        actor="exec-1",
        lease=LEASE,
        lease_owner="exec-1",
        attempts_delta=1,
        detail={"attempt": 1},
    )
    assert renewed == store.get("shop", renewed.id)
    unknown = store.transition(
        renewed,
        State.OUTCOME_UNKNOWN,
        kind="provider_answer",
        actor="exec-1",
        next_check_in=timedelta(seconds=5),
        response={"status": "unknown", "tuple": [1, 2]},
        error_code="timeout",
        possibly_sent=True,
        first_answer=True,  # not right after the claim: an event row
    )
    assert unknown == store.get("shop", unknown.id)
    done = store.transition(
        unknown,
        State.SUCCEEDED,
        kind="status_query",
        actor="reconciler",
        provider_reference="ref_1",
        response={"status": "succeeded"},
        resolution="status_query",
        checks_delta=1,
    )
    assert done == store.get("shop", done.id)
    assert (done.version, done.attempts, done.checks) == (4, 1, 1)
    assert [e.kind for e in store.events("shop", done.id)] == [
        "claimed",
        "attempt",
        "provider_answer",
        "status_query",
    ]
    assert event_rows(store, done.id) == 3  # the claim's event is kept on the row


def test_an_uneventful_payment_writes_no_event_row_and_tells_the_same_timeline(
    store: Store, executor: Executor, sandbox: SandboxServer
) -> None:
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key="order-1", request=PAYMENT
    )
    assert outcome.state is State.SUCCEEDED
    record = store.get("shop", outcome.operation_id)
    assert effects(sandbox, store, "shop", record.id) == 1
    assert event_rows(store, record.id) == 0
    claimed, answered = store.events("shop", record.id)
    assert (claimed.kind, claimed.actor, claimed.from_state, claimed.to_state) == (
        "claimed",
        "exec-1",
        None,
        "in_progress",
    )
    assert (claimed.version, claimed.created_at, claimed.operation_id) == (
        1,
        record.created_at,
        record.id,
    )
    assert claimed.detail is not None
    assert claimed.detail["idempotency_key"] == "order-1"
    assert claimed.detail["fingerprint"] == record.fingerprint
    assert (answered.kind, answered.actor, answered.from_state, answered.to_state) == (
        "provider_answer",
        "exec-1",
        "in_progress",
        "succeeded",
    )
    assert (answered.version, answered.created_at) == (2, record.completed_at)
    assert answered.detail is not None
    assert answered.detail["downstream_key"] == record.downstream_key
    assert answered.detail["provider_reference"] == record.provider_reference
    assert answered.detail["kind"] == "succeeded" and answered.detail["attempt"] == 1
    # The same key again: the first outcome, one effect, still no event row.
    again = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key="order-1", request=PAYMENT
    )
    assert again.replayed and again.operation_id == record.id
    assert effects(sandbox, store, "shop", record.id) == 1
    assert event_rows(store, record.id) == 0


def test_an_unknown_outcome_is_logged_as_before(
    store: Store, executor: Executor, sandbox: SandboxServer
) -> None:
    sandbox.inject("drop_after")  # the provider commits, the answer is lost
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key="order-2", request=PAYMENT
    )
    assert outcome.state is State.OUTCOME_UNKNOWN
    assert effects(sandbox, store, "shop", outcome.operation_id) == 1
    kinds = [(e.kind, e.to_state) for e in store.events("shop", outcome.operation_id)]
    assert kinds == [("claimed", "in_progress"), ("provider_answer", "outcome_unknown")]
    assert event_rows(store, outcome.operation_id) == 1  # the answer: an event row


@pytest.mark.parametrize("db_url", ["postgres", "citus"], indirect=True)
def test_a_write_notifies_only_an_operation_someone_waits_on(db_url: str) -> None:
    store = Store.from_url(db_url)
    dsn = sa.make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        with (
            psycopg.connect(dsn, autocommit=True) as listen,
            psycopg.connect(dsn, autocommit=True) as marker,
        ):
            listen.execute(f"LISTEN {NOTIFY_CHANNEL}")
            quiet = store.claim(new("quiet"), owner="holder", lease=LEASE).operation
            waited = store.claim(new("waited"), owner="holder", lease=LEASE).operation
            assert store.flag_waiting(waited) is not None  # as a waiter does, once it listens
            for op in (quiet, waited):
                store.transition(op, State.SUCCEEDED, kind="provider_answer", actor="holder")
            # Notifications arrive in commit order: anything the writes sent comes before it.
            marker.execute(f"NOTIFY {NOTIFY_CHANNEL}, 'marker'")
            heard = []
            for note in listen.notifies(timeout=30):
                heard.append(note.payload)
                if note.payload == "marker":
                    break
        assert heard == [f"shop:{waited.id}", "marker"]
        # A waiter that comes after the write reads it, and marks nothing.
        assert store.flag_waiting(store.get("shop", quiet.id)) is None
    finally:
        store.close()
