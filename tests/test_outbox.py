"""The transactional outbox on PostgreSQL and SQLite: staged with an operation's outcome or in
the application's own transaction, delivered at least once in order per aggregate by relays
that share the work, backed off, dead-lettered, retried by an operator.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from payorch.core import State
from payorch.errors import (
    ConfigurationError,
    DeliveryFailed,
    InvalidMessage,
    InvalidTenant,
    MessageNotFound,
    StateConflict,
)
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.outbox import (
    HOOK_FAILED,
    Message,
    OutboxHooks,
    OutboxMessage,
    Relay,
    RelayPolicy,
    RelayReport,
    _queue,
    find,
    messages,
    retry,
    stage,
    stats,
)
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.records import OperationRecord
from payorch.storage._store import Store
from payorch.storage._tables import db_now_plus, events, operations, outbox

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}
NOW = RelayPolicy(backoff_base=1.0, concurrency=1)  # with rand=0: due again at once


class Ledger:
    """A sink that records what it was handed, and fails while told to."""

    def __init__(self, fail: int = 0, error: Exception | None = None) -> None:
        self.got: list[OutboxMessage] = []
        self.fail = fail
        self.error = error or DeliveryFailed("http_503")
        self.lock = threading.Lock()

    def deliver(self, message: OutboxMessage) -> None:
        with self.lock:
            if self.fail:
                self.fail -= 1
                raise self.error
            self.got.append(message)

    def close(self) -> None:
        pass

    def ids(self) -> list[str]:
        return [m.id for m in self.got]


def receipts() -> OutboxHooks:
    hooks = OutboxHooks()

    @hooks.on("payment.create", "succeeded")
    def paid(op: OperationRecord) -> list[Message]:
        data = {"operation_id": op.id, "amount": op.amount, "reference": op.provider_reference}
        return [
            Message("receipt.requested", "payment", op.id, data, destination="email"),
            Message("ledger.post", "payment", op.id, data, destination="ledger"),
        ]

    @hooks.on("payment.create", "failed_final")
    def declined(op: OperationRecord) -> list[Message]:
        return [Message("payment.declined", "payment", op.id, {"code": op.error_code})]

    return hooks


@pytest.fixture
def hooked(db_url: str) -> Iterator[Store]:
    store = Store.from_url(db_url, outbox_hooks=receipts())
    yield store
    store.close()


@pytest.fixture
def hooked_executor(hooked: Store, sandbox_provider: SandboxProvider) -> Executor:
    return Executor(
        store=hooked,
        providers=[sandbox_provider],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
        owner="test-executor",
    )


def pay(executor: Executor, key: str, **extra: Any) -> Any:
    return executor.execute(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key=key,
        request={**PAYMENT, **extra},
    )


def rows(store: Store) -> list[dict[str, Any]]:
    with store.engine.connect() as conn:
        found = conn.execute(sa.select(outbox).order_by(outbox.c.seq))
        return [dict(r) for r in found.mappings()]


def test_a_success_stages_its_messages_with_the_outcome_and_a_replay_stages_none(
    hooked_executor: Executor, hooked: Store, sandbox: SandboxServer
) -> None:
    first = pay(hooked_executor, "order-1")
    assert first.state is State.SUCCEEDED
    pay(hooked_executor, "order-1")  # a replay settles nothing: it stages nothing
    staged = rows(hooked)
    assert [(r["type"], r["destination"]) for r in staged] == [
        ("receipt.requested", "email"),
        ("ledger.post", "ledger"),
    ]
    assert {r["operation_id"] for r in staged} == {first.operation_id}
    assert staged[0]["payload"]["reference"] == first.provider_reference
    assert staged[0]["aggregatetype"] == "payment" and staged[0]["tenant_id"] == "shop"
    email, ledger = Ledger(), Ledger()
    with Relay(hooked, {"email": email, "ledger": ledger}, policy=NOW) as relay:
        assert relay.drain().delivered == 2
        assert relay.drain().leased == 0  # delivered once: nothing left
    assert [m.type for m in email.got] == ["receipt.requested"]
    assert [m.type for m in ledger.got] == ["ledger.post"]
    assert email.got[0].attempt == 1 and email.got[0].id == staged[0]["id"]
    assert len(sandbox.ledger()) == 1


def test_an_outcome_recorded_again_after_a_lost_commit_stages_the_same_message_ids(
    hooked_executor: Executor, hooked: Store, sandbox: SandboxServer
) -> None:
    first = pay(hooked_executor, "order-lost")
    ids = [r["id"] for r in rows(hooked)]
    # A failover loses the operation and its messages (after the relay delivered them):
    # the client's retry claims anew and the provider replays the same effect.
    with hooked.engine.begin() as conn:
        for table in (outbox, events, operations):
            conn.execute(sa.delete(table))
    again = pay(hooked_executor, "order-lost")
    assert again.operation_id != first.operation_id
    assert again.provider_reference == first.provider_reference
    assert [r["id"] for r in rows(hooked)] == ids  # the receivers' dedupe still holds
    assert len(sandbox.ledger()) == 1


def test_staging_an_id_the_outbox_holds_stages_nothing(store: Store) -> None:
    first = Message("order.placed", "order", "o-1", {"n": 1}, id="same-id")
    with store.engine.begin() as conn:
        stage(conn, first)
    with store.engine.begin() as conn:
        stage(conn, Message("order.placed", "order", "o-1", {"n": 2}, id="same-id"))
    assert [(r["id"], r["payload"]) for r in rows(store)] == [("same-id", {"n": 1})]


def test_a_decline_stages_the_decline_hook_only(hooked_executor: Executor, hooked: Store) -> None:
    result = hooked_executor.execute(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key="declined-1",
        request={**PAYMENT, "payment_method": "pm_card_declined"},
    )
    assert result.state is State.FAILED_FINAL
    assert [(r["type"], r["payload"]) for r in rows(hooked)] == [
        ("payment.declined", {"code": result.error_code})
    ]


def test_a_failing_hook_never_keeps_the_outcome_from_being_recorded(
    db_url: str, sandbox_provider: SandboxProvider
) -> None:
    hooks = OutboxHooks()

    @hooks.on("payment.create", State.SUCCEEDED)
    def broken(op: OperationRecord) -> list[Message]:
        return [Message("x", "payment", op.id, {"when": object()})]  # no JSON form

    store = Store.from_url(db_url, outbox_hooks=hooks)
    try:
        executor = Executor(
            store=store, providers=[sandbox_provider], registry=default_registry("sandbox")
        )
        result = pay(executor, "hook-bug")
        assert result.state is State.SUCCEEDED
        assert store.get("shop", result.operation_id).state is State.SUCCEEDED
        (dead,) = rows(store)
        assert dead["type"] == HOOK_FAILED and dead["state"] == "dead"
        assert "InvalidMessage" in dead["last_error"] and "broken" in dead["last_error"]
        assert [m.id for m in messages(store, state="dead")] == [dead["id"]]
    finally:
        store.close()


def test_hooks_refuse_a_state_that_is_not_terminal() -> None:
    with pytest.raises(ConfigurationError, match="not terminal"):
        OutboxHooks().on("payment.create", "outcome_unknown")


def test_messages_staged_in_the_apps_transaction_commit_or_roll_back_with_it(
    store: Store,
) -> None:
    orders = sa.Table("app_orders", sa.MetaData(), sa.Column("id", sa.String, primary_key=True))
    orders.create(store.engine)
    try:
        with store.engine.begin() as conn:
            conn.execute(orders.insert().values(id="o-1"))
            (kept,) = stage(
                conn, Message("order.placed", "order", "o-1", {"n": 1}), tenant_id="shop"
            )
        with pytest.raises(RuntimeError), store.engine.begin() as conn:
            conn.execute(orders.insert().values(id="o-2"))
            stage(conn, [Message("order.placed", "order", "o-2", {"n": 2})])
            raise RuntimeError("the app's own failure")
        with Session(store.engine) as session, session.begin():
            stage(session, Message("order.paid", "order", "o-1", {"n": 3}, id="fixed-id"))
        assert [(r["id"], r["aggregateid"]) for r in rows(store)] == [
            (kept, "o-1"),
            ("fixed-id", "o-1"),
        ]
        assert find(store, "fixed-id").tenant_id == "default"
    finally:  # the application's table goes with the test (the PostgreSQL database stays)
        orders.drop(store.engine)


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (Message("t", "order", "o", {"at": object()}), "payload.at is a object"),
        (Message("t", "order", "o", {"n": float("nan")}), "JSON cannot carry"),
        (Message("t", "order", "o", {"n": 2**60}), "beyond"),
        (Message("t", "order", "o", {1: "x"}), "not a string"),
        (Message("t", "order", "o", {"s": "\ud800"}), "surrogate"),
        (Message("t", "order", "o", {"s": "a\x00b"}), "NUL"),
        (Message("t", "order", "o", ["not", "an", "object"]), "JSON object"),  # type: ignore[arg-type]
        (Message("", "order", "o", {}), "type must be"),
        (Message("t", "order", "x" * 256, {}), "longer than 255"),
        (Message("t", "order", "o", {}, destination=""), "destination must be"),
        (Message("t", "order", "o", {}, id="i" * 37), "longer than 36"),
    ],
)
def test_a_message_that_cannot_be_stored_is_refused_and_nothing_is_written(
    store: Store, message: Message, error: str
) -> None:
    good = Message("fine", "order", "o", {"n": 1})
    with pytest.raises(InvalidMessage, match=error), store.engine.begin() as conn:
        stage(conn, [good, message])
    assert rows(store) == []


def test_staging_refuses_a_bad_tenant_and_duplicate_ids(store: Store) -> None:
    with store.engine.begin() as conn:
        with pytest.raises(InvalidTenant):
            stage(conn, Message("t", "a", "1", {}), tenant_id="")
        with pytest.raises(InvalidMessage, match="share an id"):
            stage(conn, [Message("t", "a", "1", {}, id="x"), Message("t", "a", "1", {}, id="x")])
        with pytest.raises(InvalidMessage, match="no messages"):
            stage(conn, [])
    assert rows(store) == []


def settle(relay: Relay, passes: int = 20) -> RelayReport:
    """The relay's passes until one leases nothing (bounded): failed attempts due at once
    (rand=0: no backoff) are taken by the next pass, as the daemon's next tick would."""
    total = RelayReport()
    for _ in range(passes):
        report = relay.drain()
        total.add(report)
        if report.leased == 0:
            break
    return total


def _stage(store: Store, *batch: Message, tenant_id: str = "shop") -> list[str]:
    with store.engine.begin() as conn:
        return stage(conn, list(batch), tenant_id=tenant_id)


def test_one_aggregates_messages_arrive_in_order_even_through_failures(store: Store) -> None:
    ids = _stage(store, *(Message("step", "order", "o-1", {"n": n}) for n in range(5)))
    other = _stage(store, Message("step", "order", "o-2", {"n": 0}))
    sink = Ledger(fail=3)
    with Relay(store, {"default": sink}, policy=NOW, rand=lambda: 0.0) as relay:
        total = settle(relay)
    assert total.delivered == 6 and total.failed == 3 and total.dead == 0
    of_one = [m.id for m in sink.got if m.aggregate_id == "o-1"]
    assert of_one == ids
    assert other[0] in sink.ids()
    assert stats(store)["delivered"] == 6 and stats(store)["pending"] == 0


def test_an_endpoint_that_fails_for_ever_is_dead_lettered_after_max_attempts(
    store: Store,
) -> None:
    (message_id,) = _stage(store, Message("t", "order", "o-1", {}))
    (after,) = _stage(store, Message("t", "order", "o-1", {"later": True}))
    sink = Ledger(fail=1000, error=DeliveryFailed("http_410"))
    policy = RelayPolicy(max_attempts=3, backoff_base=1.0, concurrency=1)
    with Relay(store, {"default": sink}, policy=policy, rand=lambda: 0.0) as relay:
        settle(relay)
    dead = find(store, message_id)
    assert dead.state == "dead" and dead.attempts == 3 and dead.last_error == "http_410"
    # A dead message no longer holds back the later ones of its aggregate (they are tried).
    assert find(store, after).state == "dead" and sink.fail == 1000 - 6
    assert stats(store)["dead"] == 2
    assert [m.id for m in messages(store, state="dead", tenant_id="shop")] == [after, message_id]
    # The operator's retry: due now with a fresh count, audited; delivered this time.
    sink.fail = 0
    again = retry(store, message_id, actor="ops@example", reason="endpoint fixed")
    assert again.state == "pending" and again.attempts == 0
    with Relay(store, {"default": sink}, policy=policy, rand=lambda: 0.0) as relay:
        relay.drain()
    assert sink.ids() == [message_id] and find(store, message_id).state == "delivered"
    with store.engine.connect() as conn:
        (event,) = conn.execute(
            sa.select(events).where(events.c.operation_id == message_id)
        ).mappings()
    assert (event["kind"], event["actor"]) == ("outbox_retry", "ops@example")
    assert event["detail"]["reason"] == "endpoint fixed" and event["detail"]["was"] == "dead"
    with pytest.raises(StateConflict, match="delivered already"):
        retry(store, message_id, actor="ops", reason="again")
    with pytest.raises(MessageNotFound):
        retry(store, "no-such-id", actor="ops", reason="r")


def test_a_sink_that_raises_anything_is_a_failed_attempt_with_its_error(store: Store) -> None:
    (message_id,) = _stage(store, Message("t", "order", "o-1", {}))
    sink = Ledger(fail=1, error=ValueError("bug in the sink"))
    with Relay(store, {"default": sink}, policy=RelayPolicy(concurrency=1)) as relay:
        report = relay.run_once()
    assert report.failed == 1 and report.delivered == 0
    stored = find(store, message_id)
    assert stored.state == "pending" and stored.last_error == "ValueError: bug in the sink"


def test_a_receivers_retry_after_delays_the_next_attempt(store: Store) -> None:
    (message_id,) = _stage(store, Message("t", "order", "o-1", {}))
    sink = Ledger(fail=1, error=DeliveryFailed("http_429", retry_after=3600))
    with Relay(store, {"default": sink}, policy=NOW, rand=lambda: 0.0) as relay:
        relay.drain()
        assert relay.drain().leased == 0  # not due for an hour
    stored = find(store, message_id)
    assert stored.state == "pending" and stored.attempts == 1 and sink.got == []


def test_relays_for_other_destinations_and_tenants_leave_the_message_alone(
    store: Store,
) -> None:
    _stage(store, Message("t", "order", "o-1", {}, destination="email"))
    _stage(store, Message("t", "order", "o-2", {}), tenant_id="other")
    sink = Ledger()
    with Relay(store, {"default": sink}, tenant_ids={"shop"}) as relay:
        assert relay.drain().leased == 0
    assert sink.got == []


def test_a_leased_message_is_not_leased_again_until_its_lease_expires(store: Store) -> None:
    (message_id,) = _stage(store, Message("t", "order", "o-1", {}))
    first, second = Ledger(), Ledger()
    holder = Relay(store, {"default": first}, owner="relay-a")
    other = Relay(store, {"default": second}, owner="relay-b")
    leased, _ = _queue.lease_due(
        store.engine,
        owner="relay-a",
        lease_s=300,
        limit=10,
        destinations={"default"},
        max_attempts=12,
    )
    assert [m.id for m in leased] == [message_id]
    assert other.run_once().leased == 0  # relay-a holds it
    with store.engine.begin() as conn:  # relay-a was killed: its lease runs out
        conn.execute(sa.update(outbox).values(lease_expires_at=db_now_plus(sa.literal(-1.0))))
    assert other.run_once().delivered == 1
    assert second.ids() == [message_id] and first.got == []
    holder.close()
    other.close()


def test_the_relay_refuses_a_lease_shorter_than_its_batch() -> None:
    class Slow(Ledger):
        deadline = 30.0

    with pytest.raises(ConfigurationError, match="does not outlast"):
        Relay(
            "sqlite://",
            {"default": Slow()},
            policy=RelayPolicy(batch_size=50, concurrency=4, lease=timedelta(seconds=60)),
        )
    with pytest.raises(ConfigurationError, match="at least one sink"):
        Relay("sqlite://", {})
