"""An application's outbox configuration, importable by path (PAYORCH_OUTBOX_HOOKS and
PAYORCH_OUTBOX_SINKS), as the CLI and the daemon load it."""

from __future__ import annotations

from payorch.outbox import Message, OutboxHooks, OutboxMessage
from payorch.records import OperationRecord

hooks = OutboxHooks()


@hooks.on("payment.create", "succeeded")
def receipt(op: OperationRecord) -> list[Message]:
    return [Message("receipt.requested", "payment", op.id, {"operation_id": op.id})]


class Recorder:
    """A sink that keeps what it was handed (the tests run the CLI in this process)."""

    def __init__(self) -> None:
        self.got: list[OutboxMessage] = []
        self.closed = False

    def deliver(self, message: OutboxMessage) -> None:
        self.got.append(message)

    def close(self) -> None:
        self.closed = True


recorder = Recorder()
sinks = {"default": recorder}
not_hooks = {"default": recorder}
