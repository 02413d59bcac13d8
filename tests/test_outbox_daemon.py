"""The reconciler daemon relays the outbox when it has sinks, and the outbox is in the
metrics: delivery counters and the scrape-time gauges of its backlog and dead letters."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from payorch import metrics
from payorch.errors import DeliveryFailed
from payorch.observing import _metrics
from payorch.outbox import Message, OutboxMessage, Relay, RelayPolicy, find, stage
from payorch.reconciling._daemon import ReconcilerDaemon
from payorch.reconciling._reconciler import Reconciler
from payorch.storage._store import Store
from payorch.storage._tables import outbox


class Signalling:
    """A sink that sets an event once it has taken ``expected`` messages."""

    def __init__(self, expected: int) -> None:
        self.got: list[str] = []
        self.expected = expected
        self.done = threading.Event()

    def deliver(self, message: OutboxMessage) -> None:
        self.got.append(message.id)
        if len(self.got) >= self.expected:
            self.done.set()

    def close(self) -> None:
        pass


def test_the_daemon_relays_the_outbox_on_its_own_timer(store: Store) -> None:
    with store.engine.begin() as conn:
        ids = stage(conn, [Message("t", "order", f"o-{n}", {"n": n}) for n in range(3)])
    sink = Signalling(expected=3)
    relay = Relay(store, {"default": sink})
    daemon = ReconcilerDaemon(
        Reconciler(store=store, providers=[]),
        interval=timedelta(seconds=60),
        relay=relay,
        relay_interval=timedelta(seconds=60),
    )
    daemon.start()
    try:
        assert sink.done.wait(timeout=60)  # the first relay pass runs at start-up
    finally:
        daemon.stop()
        relay.close()
    assert sorted(sink.got) == sorted(ids)
    assert {find(store, i).state for i in ids} == {"delivered"}


def _samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    exposed = metrics.exposition()
    assert exposed is not None
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exposed[0].decode())
        for s in family.samples
    }


def test_the_outbox_in_the_metrics(store: Store) -> None:
    if not metrics.AVAILABLE:
        pytest.fail("prometheus-client is a dev dependency")
    with store.engine.begin() as conn:
        ok, bad, waiting = stage(
            conn,
            [
                Message("t", "order", "o-1", {}, destination="metrics-ok"),
                Message("t", "order", "o-2", {}, destination="metrics-bad"),
                Message("t", "order", "o-3", {}, destination="elsewhere"),
            ],
            tenant_id="shop",
        )
        conn.execute(sa.update(outbox).where(outbox.c.id == waiting).values(state="dead"))

    class Refusing(Signalling):
        def deliver(self, message: OutboxMessage) -> None:
            raise DeliveryFailed("http_400")

    before = _samples()
    sinks = {"metrics-ok": Signalling(1), "metrics-bad": Refusing(1)}
    policy = RelayPolicy(max_attempts=1, concurrency=1)
    with Relay(store, sinks, policy=policy) as relay:
        report = relay.drain()
    assert (report.delivered, report.dead) == (1, 1)
    gauges = metrics.watch(store)
    try:
        after = _samples()
    finally:  # the scrape-time gauges of this (soon closed) store go with the test
        assert metrics.registry is not None and gauges is not None
        metrics.registry.unregister(gauges)
        _metrics._watched.clear()

    def grew(destination: str, result: str) -> float:
        key = (
            "payorch_outbox_deliveries_total",
            (("destination", destination), ("result", result)),
        )
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("metrics-ok", "delivered") == 1 and grew("metrics-bad", "dead") == 1
    assert after["payorch_outbox_messages", (("state", "dead"),)] == 2
    assert after["payorch_outbox_messages", (("state", "pending"),)] == 0
    assert after["payorch_outbox_due_messages", ()] == 0
    assert after["payorch_effects_needs_attention", ()] == 0
    assert find(store, bad).state == "dead" and find(store, ok).state == "delivered"
