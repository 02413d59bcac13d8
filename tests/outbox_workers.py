"""A relay run in a child process (importable by 'spawn') that SIGKILLs itself at a point."""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from typing import Any

from payorch.outbox import (
    OutboxMessage,
    Relay,
    RelayPolicy,
    RelayReport,
    WebhookEndpoint,
    WebhookSink,
)
from payorch.storage._store import Store

POINTS = ("after_read", "after_send", "before_mark")


def relay_then_die(url: str, receiver_url: str, secret: str, point: str, nth: int) -> None:
    """Relay the outbox to ``receiver_url`` and die at ``point`` of the ``nth`` delivery:

    - ``after_read``: the batch is leased (attempts counted), nothing sent;
    - ``after_send``: the receiver answered 2xx, the sink has not returned yet;
    - ``before_mark``: the sink returned, the message is not marked delivered.
    """
    seen = [0]

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    class Dying(WebhookSink):
        def deliver(self, message: OutboxMessage) -> None:
            seen[0] += 1
            if point == "after_read" and seen[0] == nth:
                die()
            super().deliver(message)
            if point == "after_send" and seen[0] == nth:
                die()

    class DyingRelay(Relay):
        def _mark(self, message: OutboxMessage, error: Any, report: RelayReport) -> None:
            if point == "before_mark" and seen[0] == nth:
                die()
            super()._mark(message, error, report)

    store = Store.from_url(url)
    sink = Dying({"shop": WebhookEndpoint(receiver_url, secret)}, deadline=timedelta(seconds=2))
    policy = RelayPolicy(concurrency=1, lease=timedelta(seconds=300))
    DyingRelay(store, {"default": sink}, policy=policy, owner="doomed-relay").drain()
    raise SystemExit(3)  # never reached when the point was: the test checks the exit code
