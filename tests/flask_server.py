"""A Flask app with payorch's extension, served by werkzeug's threaded WSGI server in a
process of its own (``python tests/flask_server.py PORT``), for tests/test_flask.py.

The database and the sandbox come from the environment (``PAYORCH_DATABASE_URL``,
``PAYORCH_SANDBOX_URL``, ``PAYORCH_SANDBOX_WEBHOOK_SECRET``); the app refuses to start
against a database without payorch's schema, as ``Payorch.init_app`` does.
"""

from __future__ import annotations

import hashlib
import logging
import sys

from flask import Flask, Request, Response, abort, g, request
from flask.typing import ResponseReturnValue
from werkzeug.serving import run_simple

from payorch.integrations.flask import Idempotent, Payorch
from payorch.providers.sandbox import SandboxProvider
from payorch.settings import Settings


def gateway_tenant(req: Request) -> str | None:
    """Stands for the app's authentication: the tenant a gateway vouched for, or None (401)."""
    return req.headers.get("X-Tenant-Id")


def create_app() -> Flask:
    env = Settings()
    sandbox = SandboxProvider(base_url=env.sandbox_url, webhook_secret=env.sandbox_webhook_secret)
    app = Flask(__name__)
    payorch = Payorch(app, url=env.database_url, providers=[sandbox], tenant=gateway_tenant)
    app.register_blueprint(payorch.blueprint())

    @app.before_request
    def audit() -> None:
        # Stands for an audit log or an HMAC check that reads the body before any view.
        if request.headers.get("X-Audit") == "read-body":
            request.get_json(silent=True)
            g.audited = hashlib.sha256(request.get_data()).hexdigest()

    @app.after_request
    def audited(response: Response) -> Response:
        if "audited" in g:
            response.headers["X-Audited-Sha256"] = g.audited  # the hook did see the body
        return response

    @app.post("/payments")
    @payorch.operation("payment.create", status_code=201)
    def create_payment(op: Idempotent) -> Response:
        return op.run({"capture_method": "automatic", **op.payload})

    @app.post("/guarded")
    @payorch.operation("payment.create")
    def guarded(op: Idempotent) -> ResponseReturnValue:
        abort(403)  # the view refuses the Flask way: its status, nothing executed

    app.add_url_rule("/as-sent", view_func=payorch.endpoint("payment.create"), methods=["POST"])

    @app.get("/health")
    def health() -> dict[str, bool]:
        return {"ok": True}

    return app


def main(port: int) -> None:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    run_simple("127.0.0.1", port, create_app(), threaded=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
