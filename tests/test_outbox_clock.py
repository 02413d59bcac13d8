"""A relay signs with the database's time, not its host's (issue 34).

Standard Webhooks receivers refuse a ``webhook-timestamp`` more than five minutes from their
own clock. A relay on a host whose clock runs ten minutes fast must still deliver: its
sinks stamp :meth:`OutboxMessage.now`, the database's time read with the batch's lease and
carried forward by the host's monotonic clock.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta, tzinfo

import httpx
import pytest
import respx
from outbox_receiver import SECRET, Receiver, message, receiving
from standardwebhooks.webhooks import Webhook

from payorch.outbox import (
    Message,
    Relay,
    RelayPolicy,
    WebhookEndpoint,
    WebhookSink,
    _sinks,
    _webhooks,
    find,
    stage,
)
from payorch.outbox._sinks import LeaseClock
from payorch.storage._store import Store

FAST = timedelta(minutes=10)
URL = "https://merchant.example/hooks/payorch"


@pytest.fixture
def merchant() -> Iterator[Receiver]:
    with receiving(SECRET) as endpoint:
        yield endpoint


class FastDatetime(datetime):
    @classmethod
    def now(cls, tz: tzinfo | None = None) -> FastDatetime:
        return cls.fromtimestamp(time.time(), tz)


@pytest.fixture
def fast_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay's host clock ten minutes ahead: ``time.time`` and the outbox modules'
    ``datetime.now``. (The receiver's check calls the real ``datetime.now``, which does
    not go through ``time.time``: it keeps the true time.)"""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + FAST.total_seconds())
    for module in (_sinks, _webhooks):
        monkeypatch.setattr(module, "datetime", FastDatetime)


def test_a_relay_on_a_fast_host_still_delivers_what_receivers_accept(
    store: Store, merchant: Receiver, fast_host: None
) -> None:
    with store.engine.begin() as conn:
        (sent,) = stage(conn, Message("order.paid", "order", "o-1", {"n": 1}), tenant_id="t1")
    sink = WebhookSink({"t1": WebhookEndpoint(merchant.url, SECRET)}, deadline=timedelta(seconds=5))
    with Relay(store, {"default": sink}, policy=RelayPolicy(concurrency=1)) as relay:
        report = relay.drain()
    assert (report.delivered, report.failed, merchant.refused) == (1, 0, 0), report.errors
    assert merchant.applied == {sent: {"n": 1}}
    assert find(store, sent).state == "delivered"
    # Signed with the database's time, not the host's ten minutes ahead.
    [stamp] = merchant.timestamps
    assert abs(int(stamp) - store.db_time().timestamp()) < FAST.total_seconds() / 2
    assert int(stamp) < time.time() - FAST.total_seconds() / 2


def test_the_sink_signs_the_time_the_lease_clock_gives() -> None:
    at = datetime(2025, 3, 1, 12, 30, 45, tzinfo=UTC)
    # A monotonic reading still ahead: no time has passed since the database said ``at``.
    clock = LeaseClock(database_time=at, monotonic=time.monotonic() + 3600)
    m = message(clock=clock)
    assert m.now() == at
    with respx.mock() as router:
        route = router.post(URL).respond(204)
        sink = WebhookSink({"t1": WebhookEndpoint(URL, SECRET)})
        try:
            sink.deliver(m)
        finally:
            sink.close()
    request: httpx.Request = route.calls[-1].request
    assert request.headers["webhook-timestamp"] == str(int(at.timestamp()))
    # The signature covers that timestamp (the spec's formula, by the official signer).
    expected = Webhook(SECRET).sign(m.id, at, request.content.decode())
    assert request.headers["webhook-signature"] == expected


def test_the_lease_clock_counts_forward_by_the_monotonic_clock() -> None:
    at = datetime(2025, 3, 1, 12, 30, 45, tzinfo=UTC)
    clock = LeaseClock(database_time=at, monotonic=time.monotonic() - 30.0)  # leased 30 s ago
    assert clock.now() >= at + timedelta(seconds=30)
    m = message()
    assert replace(m, clock=clock) == m  # the clock is how it was leased, not the message
