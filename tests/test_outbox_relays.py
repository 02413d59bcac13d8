"""Several relays over one outbox share the work: every message is delivered, none twice
while its lease holds, and one aggregate's messages arrive in order, on PostgreSQL (SKIP
LOCKED) and SQLite (one writer)."""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from payorch.outbox import Message, OutboxMessage, Relay, RelayPolicy, find, stage
from payorch.storage._store import Store

AGGREGATES = 12
STEPS = 5
RELAYS = 4


class Shared:
    """One receiver behind every relay's sink: what arrived, in arrival order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arrived: list[OutboxMessage] = []
        self.start = threading.Barrier(RELAYS, timeout=60)

    def deliver(self, message: OutboxMessage) -> None:
        with self.lock:
            self.arrived.append(message)

    def close(self) -> None:
        pass


def test_relays_share_the_work_without_duplicates_and_keep_each_aggregates_order(
    store: Store,
) -> None:
    with store.engine.begin() as conn:
        ids = stage(
            conn,
            [
                Message("step", "order", f"o-{a}", {"step": s})
                for s in range(STEPS)
                for a in range(AGGREGATES)
            ],
            tenant_id="shop",
        )
    shared = Shared()

    def relay(n: int) -> int:
        policy = RelayPolicy(batch_size=5, concurrency=1)
        with Relay(store, {"default": shared}, policy=policy, owner=f"relay-{n}") as mine:
            shared.start.wait()  # all four start together, over the same backlog
            delivered = 0
            for _ in range(AGGREGATES * STEPS):  # bounded: more passes than messages
                report = mine.drain()
                delivered += report.delivered
                if report.leased == 0 and all_done(store, ids):
                    break
            return delivered

    with ThreadPoolExecutor(RELAYS) as pool:
        counts = list(pool.map(relay, range(RELAYS)))
    arrived = [m.id for m in shared.arrived]
    assert sorted(arrived) == sorted(ids)  # every message, none twice
    assert sum(counts) == len(ids)
    steps: dict[str, list[int]] = defaultdict(list)
    for m in shared.arrived:
        steps[m.aggregate_id].append(m.payload["step"])
    assert all(order == list(range(STEPS)) for order in steps.values())


def all_done(store: Store, ids: list[str]) -> bool:
    return all(find(store, i).state == "delivered" for i in ids[-AGGREGATES:])
