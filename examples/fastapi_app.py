"""payorch behind FastAPI, against the loopback sandbox: one dependency per endpoint.

Run it from a checkout (SQLite by default, or set PAYORCH_DATABASE_URL; install with
`pip install '.[fastapi]'`):

    export PAYORCH_SANDBOX_WEBHOOK_SECRET=whsec_c2FuZGJveC1yZWNpcGUtc2VjcmV0LTEyMzQ1Ng==
    payorch sandbox serve --webhook-url 'http://127.0.0.1:8000/webhooks/{tenant}/sandbox' &
    payorch db upgrade
    uvicorn fastapi_app:app --app-dir examples --port 8000
    curl -i localhost:8000/payments -H 'X-Tenant-Id: shop-1' -H 'Idempotency-Key: "order-1"' \
         -H 'Content-Type: application/json' -d '{"amount": 1999, "currency": "EUR"}'

An unknown outcome (a 202 with a Location to poll) is settled by evidence: the sandbox's
signed webhook, which it posts to this app's `POST /webhooks/{tenant}/sandbox` when started
with `--webhook-url` as above (signed with the secret both read from
PAYORCH_SANDBOX_WEBHOOK_SECRET), or, without a webhook target, `payorch reconcile once` /
`payorch reconcile run` asking the sandbox. To make one: add `--fault-next timeout
--webhook-delay 30s` to the sandbox (docs/sandbox.md, "testing your service's
unknown-outcome handling").
"""

from typing import Annotated

from fastapi import Depends, FastAPI
from fastapi.responses import Response

from payorch.integrations.fastapi import Idempotent, Payorch, header_tenant
from payorch.providers.sandbox import SandboxProvider
from payorch.settings import Settings

env = Settings()  # PAYORCH_DATABASE_URL, PAYORCH_SANDBOX_URL, PAYORCH_SANDBOX_WEBHOOK_SECRET
sandbox = SandboxProvider(base_url=env.sandbox_url, webhook_secret=env.sandbox_webhook_secret)
payorch = Payorch(
    url=env.database_url,
    providers=[sandbox],
    tenant=header_tenant("X-Tenant-Id"),  # set by a trusted gateway; never read from the body
)
app = FastAPI(lifespan=payorch.lifespan, exception_handlers=payorch.exception_handlers)
app.include_router(payorch.router())  # POST /webhooks/{tenant}/{provider}, GET /operations/{id}

CreatePayment = Annotated[Idempotent, Depends(payorch.operation("payment.create", status_code=201))]


@app.post("/payments")
async def create_payment(op: CreatePayment) -> Response:
    # The tenant, the key and the JSON body are checked; shape the request to execute here.
    return await op.run({"capture_method": "automatic", **op.payload})


@app.get("/health")
async def health() -> dict[str, bool]:
    return {"ok": True}
