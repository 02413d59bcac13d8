"""kill -9 of a relay process at each point of a delivery: after reading, after sending,
before marking. Whatever the point, every message reaches the merchant's endpoint at least
once, the endpoint (deduping on ``webhook-id``) applies each exactly once, and every
message ends delivered, on PostgreSQL and SQLite.
"""

from __future__ import annotations

import multiprocessing
import signal
from datetime import timedelta

import pytest
import sqlalchemy as sa
from outbox_receiver import SECRET, Receiver, receiving
from outbox_workers import POINTS, relay_then_die

from payorch.outbox import Message, Relay, RelayPolicy, WebhookEndpoint, WebhookSink, stage
from payorch.storage._store import Store
from payorch.storage._tables import db_now_plus, outbox

# Two aggregates: one order's three steps (their order matters) and one refund.
BATCH = [
    *(Message("order.step", "order", "o-1", {"step": n}) for n in range(3)),
    Message("refund.created", "refund", "r-1", {"amount": 500}),
]


def _run_and_kill(url: str, receiver: Receiver, point: str, nth: int) -> None:
    proc = multiprocessing.get_context("spawn").Process(
        target=relay_then_die, args=(url, receiver.url, SECRET, point, nth)
    )
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == -signal.SIGKILL, f"the relay ended with {proc.exitcode}"


def _leases_run_out(store: Store) -> None:
    """The dead relay's leases expire (as they would once their time passed)."""
    with store.engine.begin() as conn:
        conn.execute(
            sa.update(outbox)
            .where(outbox.c.lease_owner == "doomed-relay")
            .values(lease_expires_at=db_now_plus(sa.literal(-1.0)))
        )


@pytest.mark.parametrize("nth", [1, 2], ids=["first", "second"])
@pytest.mark.parametrize("point", POINTS)
def test_a_relay_killed_at_any_point_loses_nothing_and_the_endpoint_applies_each_once(
    store: Store, point: str, nth: int
) -> None:
    with store.engine.begin() as conn:
        ids = stage(conn, BATCH, tenant_id="shop")
    with receiving() as receiver:
        _run_and_kill(store.engine.url.render_as_string(hide_password=False), receiver, point, nth)
        before = list(receiver.received)
        _leases_run_out(store)
        sink = WebhookSink(
            {"shop": WebhookEndpoint(receiver.url, SECRET)}, deadline=timedelta(seconds=2)
        )
        with Relay(store, {"default": sink}, policy=RelayPolicy(concurrency=1)) as relay:
            for _ in range(10):  # bounded: a pass per message of the longest aggregate, and more
                if relay.drain().leased == 0:
                    break
        # Every message arrived at least once, and was applied exactly once.
        assert set(receiver.received) == set(ids)
        assert sorted(receiver.applied) == sorted(ids)
        assert [receiver.applied[i]["step"] for i in ids[:3]] == [0, 1, 2]
        # What the killed relay had sent is what arrived twice, nothing else.
        duplicates = len(receiver.received) - len(ids)
        assert duplicates == (0 if point == "after_read" else 1)
        assert len(before) == nth - (1 if point == "after_read" else 0)
        # One order's steps reached the endpoint in order, duplicates included.
        steps = [i for i in receiver.received if i in ids[:3]]
        assert sorted(dict.fromkeys(steps), key=steps.index) == ids[:3]
    with store.engine.connect() as conn:
        states = conn.execute(sa.select(outbox.c.id, outbox.c.state, outbox.c.attempts)).all()
    assert {state for _, state, _ in states} == {"delivered"}
    # The killed attempt counted (a message that kills every relay that reads it dies):
    # what the dead relay leased and never marked took a second attempt.
    attempts = {message_id: n for message_id, _, n in states}
    assert set(attempts.values()) <= {1, 2} and 2 in attempts.values()
