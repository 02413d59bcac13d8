"""The outbox's bounds hold where a relay never gets to say so: a message every relay dies
on is dead after max_attempts, a receiver's endless Retry-After is capped, a stopping relay
hands back what it has not sent, a failure from a stale lease changes nothing; a hook's
ids are stable and unique or refused; what the database refuses never loses an outcome;
delivered messages are purged after an age."""

from __future__ import annotations

import functools
import threading
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from payorch.core import State
from payorch.errors import ConfigurationError, DeliveryFailed, InvalidMessage, StateConflict
from payorch.outbox import (
    HOOK_FAILED,
    Message,
    OutboxHooks,
    OutboxMessage,
    Relay,
    RelayPolicy,
    _queue,
    find,
    messages,
    purge,
    retry,
    stage,
)
from payorch.storage import _outbox
from payorch.storage._store import Store
from payorch.storage._tables import db_now_plus, outbox


def _one(store: Store, **kw: Any) -> str:
    with store.engine.begin() as conn:
        (message_id,) = stage(conn, Message("t", "order", "o-1", {"n": 1}, **kw), tenant_id="shop")
    return message_id


def _expire(store: Store) -> None:
    with store.engine.begin() as conn:
        conn.execute(sa.update(outbox).values(lease_expires_at=db_now_plus(sa.literal(-1.0))))


class Counting:
    def __init__(self, error: Exception | None = None) -> None:
        self.calls = 0
        self.error = error

    def deliver(self, message: OutboxMessage) -> None:
        self.calls += 1
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        pass


def test_a_message_every_relay_dies_on_is_dead_after_max_attempts(store: Store) -> None:
    message_id = _one(store)
    for _ in range(3):  # three relays lease it and die before recording anything
        leased, dead = _queue.lease_due(
            store.engine,
            owner="doomed",
            lease_s=60,
            limit=10,
            destinations={"default"},
            max_attempts=3,
        )
        assert [m.id for m in leased] == [message_id] and dead == 0
        _expire(store)
    sink = Counting()
    with Relay(store, {"default": sink}, policy=RelayPolicy(max_attempts=3)) as relay:
        report = relay.drain()
    assert (report.dead, report.leased, sink.calls) == (1, 0, 0)
    stored = find(store, message_id)
    assert stored.state == "dead" and stored.attempts == 3
    assert "no relay finished it in 3 attempts" in (stored.last_error or "")


@pytest.mark.parametrize("retry_after", [1e12, float("inf"), float("nan"), -5.0])
def test_a_receivers_retry_after_never_wedges_a_message(store: Store, retry_after: float) -> None:
    message_id = _one(store)
    sink = Counting(DeliveryFailed("http_503", retry_after=retry_after))
    policy = RelayPolicy(backoff_cap=60.0, concurrency=1)
    with Relay(store, {"default": sink}, policy=policy) as relay:
        assert relay.drain().failed == 1
    stored = find(store, message_id)  # readable: the delay was capped
    assert stored.state == "pending"
    assert stored.next_attempt_at - stored.created_at <= timedelta(seconds=60 + 3600)
    assert [m.id for m in messages(store)] == [message_id]


def test_an_endless_retry_after_is_no_answer() -> None:
    assert DeliveryFailed("x", retry_after=float("inf")).retry_after is None
    assert DeliveryFailed("x", retry_after=float("nan")).retry_after is None
    assert DeliveryFailed("x", retry_after=12.0).retry_after == 12.0


def test_a_stopping_relay_hands_back_what_it_has_not_sent(store: Store) -> None:
    with store.engine.begin() as conn:
        ids = stage(conn, [Message("t", "order", f"o-{n}", {}) for n in range(3)])
    stop = threading.Event()

    class StopsAfterOne(Counting):
        def deliver(self, message: OutboxMessage) -> None:
            super().deliver(message)
            stop.set()  # SIGTERM arrives while the first message is being delivered

    sink = StopsAfterOne()
    with Relay(store, {"default": sink}, policy=RelayPolicy(concurrency=1)) as relay:
        report = relay.drain(stop=stop)
    assert (report.delivered, report.released, sink.calls) == (1, 2, 1)
    rest = [find(store, i) for i in ids[1:]]
    assert all(m.state == "pending" and m.attempts == 0 and m.lease_owner is None for m in rest)
    with Relay(store, {"default": Counting()}) as relay:  # the next relay takes them at once
        assert relay.drain().delivered == 2


def test_a_failure_from_a_stale_lease_changes_nothing(store: Store) -> None:
    message_id = _one(store)
    lease = functools.partial(
        _queue.lease_due,
        store.engine,
        lease_s=60,
        limit=10,
        destinations={"default"},
        max_attempts=5,
    )
    (stale,), _ = lease(owner="relay-a")
    _expire(store)
    (fresh,), _ = lease(owner="relay-a")  # the same owner leases it again (a new attempt)
    assert fresh.attempt == stale.attempt + 1
    state = _queue.failed(
        store.engine, stale, owner="relay-a", error="late", delay_s=0, max_attempts=5
    )
    assert state is None
    stored = find(store, message_id)
    assert stored.lease_owner == "relay-a" and stored.last_error is None


@pytest.mark.parametrize("field", ["type", "aggregate_type", "aggregate_id", "destination", "id"])
def test_a_nul_or_a_lone_surrogate_in_any_field_is_refused(store: Store, field: str) -> None:
    for bad in ("a\x00b", "a\ud800b"):
        fields = {"type": "t", "aggregate_type": "a", "aggregate_id": "1", "payload": {}}
        fields[field] = bad
        with pytest.raises(InvalidMessage), store.engine.begin() as conn:
            stage(conn, Message(**fields))
    with pytest.raises(InvalidMessage, match="key with a NUL"), store.engine.begin() as conn:
        stage(conn, Message("t", "a", "1", {"k\x00": 1}))
    assert messages(store) == []


def test_hooks_need_stable_unique_names() -> None:
    hooks = OutboxHooks()
    hooks.on("payment.create", "succeeded")(lambda op: [])
    with pytest.raises(ConfigurationError, match="two outbox hooks named"):
        hooks.on("payment.create", "succeeded")(lambda op: [])
    hooks.on("payment.create", "succeeded", name="second")(lambda op: [])
    with pytest.raises(ConfigurationError, match="needs name="):
        hooks.on("payment.create", "failed_final")(functools.partial(lambda op, x: [], x=1))
    hooks.on("payment.create", "failed_final", name="partial")(
        functools.partial(lambda op, x: [], x=1)
    )
    assert hooks.wants("payment.create", State.FAILED_FINAL)


def test_a_hook_failed_message_is_never_retried_to_a_sink(store: Store) -> None:
    with store.engine.begin() as conn:
        (message_id,) = stage(conn, Message(HOOK_FAILED, "operation", "op-1", {"error": "x"}))
        conn.execute(sa.update(outbox).values(state="dead"))
    with pytest.raises(StateConflict, match="fix the hook"):
        retry(store, message_id, actor="ops", reason="try again")
    assert find(store, message_id).state == "dead"


def test_delivered_messages_are_purged_after_an_age_and_the_others_kept(store: Store) -> None:
    with store.engine.begin() as conn:
        old, fresh, dead, pending = stage(
            conn, [Message("t", "order", f"o-{n}", {}) for n in range(4)]
        )
        conn.execute(
            sa.update(outbox)
            .where(outbox.c.id.in_([old, fresh, dead]))
            .values(state="delivered", delivered_at=db_now_plus(sa.literal(-3600.0)))
        )
        conn.execute(
            sa.update(outbox)
            .where(outbox.c.id == fresh)
            .values(delivered_at=db_now_plus(sa.literal(0.0)))
        )
        conn.execute(sa.update(outbox).where(outbox.c.id == dead).values(state="dead"))
    assert purge(store, older_than=timedelta(minutes=30), dry_run=True) == 1
    assert purge(store, older_than=timedelta(minutes=30)) == 1
    assert sorted(m.id for m in messages(store)) == sorted([fresh, dead, pending])


def test_rows_the_database_refuses_never_lose_the_outcome(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every check bypassed: a NUL reaches the database (PostgreSQL refuses it; SQLite keeps it).
    monkeypatch.setattr(_outbox, "_text", lambda *a: None)
    hooks = OutboxHooks()
    hooks.on("payment.create", "succeeded", name="nul")(
        lambda op: [Message("bad\x00type", "payment", op.id, {})]
    )
    store = Store.from_url(db_url, outbox_hooks=hooks)
    try:
        from cli_helpers import claim

        record = claim(store, "k-1")
        done = store.transition(record, State.SUCCEEDED, kind="provider_answer", actor="w")
        assert store.get(done.tenant_id, done.id).state is State.SUCCEEDED
        (row,) = messages(store)
        if store.is_postgres:
            assert row.type == HOOK_FAILED and row.state == "dead"
            assert "DataError" in (row.last_error or "")
        else:
            assert row.type == "bad\x00type"
    finally:
        store.close()
