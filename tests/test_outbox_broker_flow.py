"""End to end through a real broker: payments settle and stage their ledger postings, a
relay publishes them to Redis Streams (a redis-server the tests start), and a consumer group
applies them through ``payorch.once.consumer``. The consumer dies before acknowledging and
a second one takes its entries over; the relay publishes one message twice: every posting
is applied once, on PostgreSQL and SQLite."""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa

from payorch import once
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.outbox import Message, OutboxHooks, OutboxMessage, Relay, RelayPolicy, _queue
from payorch.outbox.redis import RedisStreamReader, RedisStreamSink
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.records import OperationRecord
from payorch.storage._store import Store
from payorch.storage._tables import outbox

pytest_plugins = ["redis_server"]

STREAM = "payorch:shop:payment"


def _hooks() -> OutboxHooks:
    hooks = OutboxHooks()

    @hooks.on("payment.create", "succeeded")
    def post(op: OperationRecord) -> list[Message]:
        return [Message("ledger.post", "payment", op.id, {"op": op.id, "amount": op.amount})]

    return hooks


class Died(Exception):
    """Stands for the consumer process dying after applying, before acknowledging."""


def test_postings_reach_the_ledger_once_through_a_broker(
    db_url: str, redis_url: str, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    store = Store.from_url(db_url, outbox_hooks=_hooks())
    ledger: list[tuple[str, int]] = []

    @once.consumer(store, name="ledger.postings")
    def apply(message: once.InboundMessage) -> dict[str, int]:
        ledger.append((message.payload["op"], message.payload["amount"]))
        return {"entry": len(ledger)}

    try:
        executor = Executor(
            store=store, providers=[sandbox_provider], registry=default_registry("sandbox")
        )
        ops = [
            executor.execute(
                tenant_id="shop",
                operation="payment.create",
                idempotency_key=f"order-{n}",
                request={"amount": 100 + n, "currency": "EUR", "customer": "cus_1"},
            )
            for n in range(4)
        ]
        sink = RedisStreamSink(redis_url)
        with Relay(
            store, {"default": sink}, policy=RelayPolicy(batch_size=10, concurrency=1)
        ) as relay:
            assert relay.drain().delivered == 4
            first = relay.drain()
        assert first.leased == 0
        # A relay that died before marking publishes one message again: deduped at append.
        RedisStreamSink(redis_url).deliver(first_message(store))

        reader = RedisStreamReader(redis_url, stream=STREAM, group="ledger", consumer="c-1")
        reader.ensure_group()
        entries = reader.read(count=10)
        assert len(entries) == 4  # four postings, the re-sent one appended once
        for i, entry in enumerate(entries):
            apply(entry.id, entry.payload())
            if i == 1:
                break  # c-1 dies here: two applied, none acknowledged
        # c-2 takes over what c-1 left unacknowledged, from the start.
        taker = RedisStreamReader(redis_url, stream=STREAM, group="ledger", consumer="c-2")
        taken = taker.claim_idle(min_idle=timedelta(0), count=10)
        assert sorted(e.id for e in taken) == sorted(e.id for e in entries)
        answers = [apply(e.id, e.payload()) for e in taken]
        assert taker.ack(*taken) == 4
        reader.close()
        taker.close()
    finally:
        store.close()
    assert sorted(op for op, _ in ledger) == sorted(o.operation_id for o in ops)  # once each
    assert [a["entry"] for a in answers[:2]] == [1, 2]  # the first two replayed their result
    assert len(sandbox.ledger()) == 4


def first_message(store: Store) -> OutboxMessage:
    """One staged message as a relay hands it to a sink."""
    with store.engine.connect() as conn:
        row = conn.execute(sa.select(outbox).limit(1)).mappings().one()
    return _queue._message(row)
