"""The README's embedding example, runnable: `python examples/embed.py` (needs the sandbox)."""

from datetime import timedelta

from payorch import Executor, PayorchError, Store, default_registry, http_answer
from payorch.migrate import upgrade
from payorch.providers.sandbox import SandboxProvider, SandboxServer

url = "sqlite:///payments.db"  # or postgresql+psycopg://user@host/db
upgrade(url)  # same as `payorch db upgrade`
with SandboxServer() as acquirer, SandboxProvider(base_url=acquirer.url) as sandbox:
    payments = Executor(
        store=Store.from_url(url),
        providers=[sandbox],
        registry=default_registry(provider="sandbox"),
        lease=timedelta(seconds=60),  # must outlast the whole provider call
    )
    try:
        outcome = payments.execute(
            tenant_id="shop-1",
            operation="payment.create",
            idempotency_key="order-1001",  # the client's Idempotency-Key header
            request={"amount": 1999, "currency": "EUR", "customer": "cus_42"},
        )
        answer = http_answer(outcome)  # 200 succeeded, 402 declined, 202 being reconciled
    except PayorchError as refused:
        answer = http_answer(refused)  # 409 + Retry-After, 422 key reused, 410, 400
    print(answer.status, answer.headers, answer.body)
