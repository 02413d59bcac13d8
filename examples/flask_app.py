"""payorch behind Flask, against the loopback sandbox: one decorator per view.

Run it from a checkout (SQLite by default, or set PAYORCH_DATABASE_URL; install with
`pip install '.[flask]'`):

    export PAYORCH_SANDBOX_WEBHOOK_SECRET=whsec_c2FuZGJveC1yZWNpcGUtc2VjcmV0LTEyMzQ1Ng==
    payorch sandbox serve --webhook-url 'http://127.0.0.1:8000/webhooks/{tenant}/sandbox' &
    payorch db upgrade
    python examples/flask_app.py --port 8000     # or: flask --app examples/flask_app.py run
    curl -i localhost:8000/payments -H 'X-Tenant-Id: shop-1' -H 'Idempotency-Key: "order-1"' \
         -H 'Content-Type: application/json' -d '{"amount": 1999, "currency": "EUR"}'

Without `payorch db upgrade`, or without the webhook secret, the app refuses to start and
says why in one line (run as a script; `flask run` prints Flask's traceback of the same
error, whose last line is that reason). An unknown outcome (a 202) is settled by evidence: the
sandbox's signed webhook, which it posts to this app's `POST /webhooks/<tenant>/sandbox` when
started with `--webhook-url` as above (signed with the secret both read from
PAYORCH_SANDBOX_WEBHOOK_SECRET), or `payorch reconcile once` / `payorch reconcile run` asking
the sandbox.
"""

import argparse
import sys

from flask import Flask, Response
from pydantic import ValidationError

from payorch.errors import PayorchError
from payorch.integrations.flask import Idempotent, Payorch, header_tenant
from payorch.providers.sandbox import SandboxProvider
from payorch.settings import Settings


def create_app() -> Flask:
    """The app (an application factory: `flask --app examples/flask_app.py` calls it too)."""
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

    return app


def main(argv: list[str] | None = None) -> int:
    """Serve the app with werkzeug's server; a refusal to start is one line and exit 1."""
    parser = argparse.ArgumentParser(description="payorch's Flask example")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    try:
        app = create_app()
    except PayorchError as exc:  # an unmigrated database, a missing secret, ...
        print(f"payorch cannot start: {exc.message}", file=sys.stderr)
        return 1
    except ValidationError as exc:  # a PAYORCH_* variable refused
        first = exc.errors()[0]
        name = "PAYORCH_" + "_".join(str(part) for part in first["loc"]).upper()
        print(f"payorch cannot start: {name}: {first['msg']}", file=sys.stderr)
        return 1
    app.run(host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
