"""payorch's ASGI middleware around two apps, served by uvicorn (``--factory``) for
tests/test_asgi_middleware.py: ``plain_app`` wraps a hand-written ASGI app that speaks no
lifespan; ``starlette_app`` a Starlette app with a lifespan of its own, which writes its
events to the file ``ASGI_TEST_EVENTS`` names (so a test sees that it got them).

The database and the sandbox come from the environment, as for the examples.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from payorch.integrations.asgi import (
    ASGIApp,
    OperationRoute,
    PayorchMiddleware,
    Receive,
    Scope,
    Send,
)
from payorch.providers.sandbox import SandboxProvider
from payorch.settings import Settings

ROUTES: dict[tuple[str, str], str | OperationRoute] = {
    ("POST", "/payments"): OperationRoute("payment.create", status_code=201),
    ("POST", "/as-sent"): "payment.create",
}


async def gateway_tenant(scope: Scope) -> str | None:
    """Stands for the app's authentication (async, as one reading a session would be)."""
    for name, value in scope["headers"]:
        if name == b"x-tenant-id":
            return str(value.decode("latin-1"))
    return None


def _wrapped(app: ASGIApp) -> PayorchMiddleware:
    env = Settings()
    sandbox = SandboxProvider(base_url=env.sandbox_url, webhook_secret=env.sandbox_webhook_secret)
    return PayorchMiddleware(
        app, url=env.database_url, providers=[sandbox], routes=ROUTES, tenant=gateway_tenant
    )


async def _plain(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return  # no lifespan here: the middleware runs it alone
    found = scope["path"] == "/health"
    body = json.dumps({"ok": True} if found else {"app": "plain", "path": scope["path"]})
    headers = [(b"content-type", b"application/json")]
    status = 200 if found else 404
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body.encode()})


def plain_app() -> PayorchMiddleware:
    return _wrapped(_plain)


def starlette_app() -> PayorchMiddleware:
    events = Path(os.environ["ASGI_TEST_EVENTS"])

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        events.write_text("started\n")
        yield
        with events.open("a") as f:
            f.write("stopped\n")

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    async def payments(request: Request) -> JSONResponse:
        return JSONResponse({"app": "starlette", "listing": []})  # GET: the app's, not payorch's

    app = Starlette(
        routes=[Route("/health", health), Route("/payments", payments, methods=["GET"])],
        lifespan=lifespan,
    )
    return _wrapped(app)
