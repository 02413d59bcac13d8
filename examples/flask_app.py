"""payorch behind Flask, against the loopback sandbox: one decorator per view.

Run it from a checkout (SQLite by default, or set PAYORCH_DATABASE_URL; install with
`pip install '.[flask]'`):

    export PAYORCH_SANDBOX_WEBHOOK_SECRET=whsec_c2FuZGJveC1yZWNpcGUtc2VjcmV0LTEyMzQ1Ng==
    payorch sandbox serve --webhook-url 'http://127.0.0.1:8000/webhooks/{tenant}/sandbox' &
    payorch db upgrade
    flask --app examples/flask_app.py run --port 8000
    curl -i localhost:8000/payments -H 'X-Tenant-Id: shop-1' -H 'Idempotency-Key: "order-1"' \
         -H 'Content-Type: application/json' -d '{"amount": 1999, "currency": "EUR"}'

Without `payorch db upgrade` the app refuses to start and says so. An unknown outcome (a
202) is settled by evidence: the sandbox's signed webhook, which it posts to this app's
`POST /webhooks/<tenant>/sandbox` when started with `--webhook-url` as above (signed with the
secret both read from PAYORCH_SANDBOX_WEBHOOK_SECRET), or, without a webhook target,
`payorch reconcile once` / `payorch reconcile run` asking the sandbox.
"""

from flask import Flask, Response

from payorch.integrations.flask import Idempotent, Payorch, header_tenant
from payorch.providers.sandbox import SandboxProvider
from payorch.settings import Settings

env = Settings()  # PAYORCH_DATABASE_URL, PAYORCH_SANDBOX_URL, PAYORCH_SANDBOX_WEBHOOK_SECRET
sandbox = SandboxProvider(base_url=env.sandbox_url, webhook_secret=env.sandbox_webhook_secret)
payorch = Payorch(
    url=env.database_url,
    providers=[sandbox],
    tenant=header_tenant("X-Tenant-Id"),  # set by a trusted gateway; never read from the body
)
app = Flask(__name__)
payorch.init_app(app)  # checks the database: reachable, a primary, migrated
app.register_blueprint(payorch.blueprint())  # webhooks and operations, as in the FastAPI app


@app.post("/payments")
@payorch.operation("payment.create", status_code=201)
def create_payment(op: Idempotent) -> Response:
    # The tenant, the key and the JSON body are checked; shape the request to execute here.
    return op.run({"capture_method": "automatic", **op.payload})


@app.get("/health")
def health() -> dict[str, bool]:
    return {"ok": True}
