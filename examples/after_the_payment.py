"""After the payment, once: `python examples/after_the_payment.py` (docs/outbox.md).

A payment succeeds; its outcome stages a receipt and a ledger entry in the same transaction;
a relay delivers them at least once; the receipt sender and the ledger consumer make each
happen once. On the way the client retries, a relay fails after handing a message over,
and the mailer's answer is lost: still one payment, one receipt, one ledger entry.
"""

import tempfile
from pathlib import Path

from payorch import Executor, Store, default_registry, once
from payorch.migrate import upgrade
from payorch.outbox import Message, OutboxHooks, Relay
from payorch.providers.sandbox import SandboxProvider, SandboxServer

hooks = OutboxHooks()


@hooks.on("payment.create", "succeeded")
def after_payment(op):  # runs in the transaction that records the success
    data = {"payment": op.id, "order": op.idempotency_key, "amount": op.amount}
    return [
        Message("receipt.requested", "payment", op.id, data, destination="email"),
        Message("ledger.post", "payment", op.id, data, destination="ledger"),
    ]


class Mailer:
    """An email API that dedupes on the idempotency key it is given; its first answer is
    lost on the way back (the email went out)."""

    def __init__(self):
        self.sent, self.calls = {}, 0

    def send(self, to, body, idempotency_key):
        self.calls += 1
        self.sent.setdefault(idempotency_key, (to, body))
        if self.calls == 1:
            raise TimeoutError("the mailer's answer was lost")
        return {"id": f"mail-{len(self.sent)}"}


class Ledger:
    def __init__(self):
        self.entries = []


mailer, ledger = Mailer(), Ledger()
store = Store.from_url(f"sqlite:///{Path(tempfile.mkdtemp()) / 'shop.db'}", outbox_hooks=hooks)
upgrade(store.engine.url.render_as_string(hide_password=False))


# The mailer dedupes on our key, so a run whose answer was lost may run again (rerun_safe).
@once.idempotent(store, namespace="email.receipt", key="message_id", rerun_safe=True)
def send_receipt(message_id: str, order: str, amount: int) -> dict:
    key = once.current().downstream_key  # the same on every run for this message
    return mailer.send("customer@example.com", f"{order}: {amount}", idempotency_key=key)


@once.consumer(store, name="ledger.post")  # key: the message id; fingerprint: the payload
def post_to_ledger(message: once.InboundMessage) -> dict:
    ledger.entries.append((message.payload["payment"], message.payload["amount"]))
    return {"entry": len(ledger.entries)}


class ReceiptSink:
    def deliver(self, m):
        send_receipt(m.id, m.payload["order"], m.payload["amount"])

    def close(self):
        pass


class LedgerSink:
    def __init__(self):
        self.failed_once = False

    def deliver(self, m):
        post_to_ledger(m)
        if not self.failed_once:  # the relay "fails" after the consumer took the message
            self.failed_once = True
            raise ConnectionError("lost the broker's acknowledgement")

    def close(self):
        pass


with SandboxServer() as acquirer, SandboxProvider(base_url=acquirer.url) as sandbox:
    payments = Executor(store=store, providers=[sandbox], registry=default_registry("sandbox"))
    request = {"amount": 1999, "currency": "EUR", "customer": "cus_42"}
    for _ in range(2):  # the client retries: a replay, which stages nothing
        outcome = payments.execute(
            tenant_id="shop", operation="payment.create", idempotency_key="order-7", request=request
        )
    # rand=0: a failed delivery is due again at once (no backoff), for the example's sake.
    with Relay(store, {"email": ReceiptSink(), "ledger": LedgerSink()}, rand=lambda: 0.0) as relay:
        for _ in range(5):  # each pass delivers what is due; failures come back on the next
            relay.drain()
    print(f"payment {outcome.state.value}; effects at the acquirer: {len(acquirer.ledger())}")
    print(f"receipts sent: {len(mailer.sent)} (mailer called {mailer.calls} times)")
    print(f"ledger entries: {len(ledger.entries)}")
store.close()
