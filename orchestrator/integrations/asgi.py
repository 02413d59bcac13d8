"""A framework-free ASGI middleware: payorch answers the routes it owns, the app the rest.

::

    app = PayorchMiddleware(
        inner_app,  # any ASGI app: Starlette, Quart, Litestar, a hand-written one
        providers=[SandboxProvider(...)],
        routes={("POST", "/payments"): OperationRoute("payment.create", status_code=201)},
        tenant=header_tenant("X-Tenant-Id"),
    )

For each route of ``routes`` (a method and an exact path; the value an operation type, or an
:class:`OperationRoute`) the middleware resolves the tenant (from the request: a header, the
scope an authentication middleware filled; never the body), parses the ``Idempotency-Key``
header and the JSON body, runs the :class:`~payorch.AsyncExecutor` on the server's event
loop and answers as :func:`payorch.http.http_answer` says. It serves the webhooks
(``POST {webhooks}/{tenant}/{provider}``) and the operation resource
(``GET {operations}/{operation_id}``) too. Every other request goes to the app as it came.
The ``lifespan`` protocol checks the database on start-up (reachable, a primary, migrated)
and closes the store and the adapters' clients on shutdown; the app gets the events too.
The same contract as :mod:`payorch.integrations.fastapi`, without a framework.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeAlias

from ..errors import ConfigurationError, InvalidTenant, PayorchError
from ..execution._async import AsyncExecutor
from ..execution._executor import RetryPolicy
from ..http import (
    IDEMPOTENCY_KEY_HEADER,
    HttpAnswer,
    http_answer,
    parse_idempotency_key,
    parse_json_body,
    webhook_answer,
)
from ..operations import Registry
from ..outcome import Outcome
from ..provider import AsyncProvider
from ..reconciling._async import AsyncWebhookHandler
from ..routing import Router
from ..storage._async_store import AsyncStore
from ..storage._outbox import OutboxHooks
from ._common import (
    DEFAULT_MAX_BODY,
    Refused,
    WebhookHeaders,
    checked_operation_id,
    env_router,
    failure,
    known_tenant,
    not_allowed,
    operation_answer,
    require_webhook_secrets,
    set_up,
    too_large,
)

__all__ = [
    "ASGIApp",
    "Message",
    "OperationRoute",
    "PayorchMiddleware",
    "Receive",
    "Scope",
    "Send",
    "TenantResolver",
    "header_tenant",
]

log = logging.getLogger("payorch.asgi")

Scope: TypeAlias = MutableMapping[str, Any]
Message: TypeAlias = MutableMapping[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]
ASGIApp: TypeAlias = Callable[[Scope, Receive, Send], Awaitable[None]]
# ``(scope) -> tenant id`` (or an awaitable of it); ``None`` means "not authenticated" (401).
TenantResolver: TypeAlias = Callable[[Scope], "str | Awaitable[str | None] | None"]

_WEBHOOK_METHODS = ("POST",)
_OPERATION_METHODS = ("GET", "HEAD")


def _header_lines(scope: Scope, name: str) -> list[str]:
    wanted = name.lower().encode("latin-1")
    # Latin-1 keeps every byte: a non-ASCII value is then refused by the parsers, not lost.
    return [v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == wanted]


def header_tenant(name: str = "X-Tenant-Id") -> TenantResolver:
    """The tenant from header ``name``, set by a trusted gateway; missing or repeated: 400."""

    def tenant(scope: Scope) -> str:
        values = _header_lines(scope, name)
        if len(values) != 1 or not values[0].strip(" \t"):
            raise InvalidTenant(f"send exactly one non-empty {name} header")
        return values[0].strip(" \t")

    return tenant


@dataclass(frozen=True)
class OperationRoute:
    """What one owned route runs: the operation type; ``status_code`` (200 or 201) answers
    success; ``provider`` picks an adapter other than the type's; ``wait`` lets a duplicate
    wait for the first, up to it."""

    operation: str
    status_code: int = 200
    provider: str | None = None
    wait: timedelta | None = None

    def __post_init__(self) -> None:
        if self.status_code not in (200, 201):
            raise ConfigurationError(f"status_code must be 200 or 201, not {self.status_code}")


class _Gone(Exception):
    """The client disconnected before its body was read: nothing to run, nobody to answer."""


async def _send_answer(send: Send, answer: HttpAnswer, *, head: bool = False) -> None:
    content = answer.content()
    headers = [
        (b"content-type", answer.content_type.encode("latin-1")),
        (b"content-length", str(len(content)).encode("latin-1")),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items()),
    ]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else content})


class PayorchMiddleware:
    """Wraps ``app``; answers ``routes``, the webhooks and the operation resource itself.

    ``routes`` maps ``(method, path)`` to an operation type or an :class:`OperationRoute`;
    the path is exact (the scope's ``path`` without its ``root_path``). ``url`` (default
    ``PAYORCH_DATABASE_URL``) or an ``AsyncStore`` of the app's own (then it stays open after
    shutdown). The adapters must have the async API; the shutdown closes their clients.
    ``webhooks`` and ``operations`` are the two prefixes payorch owns (``webhooks=None``: no
    webhook route). Configuration errors (a lease shorter than a provider call, a webhook
    route for an adapter built without its webhook secret) surface here, at import.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        providers: Iterable[AsyncProvider],
        routes: Mapping[tuple[str, str], str | OperationRoute],
        url: str | None = None,
        store: AsyncStore | None = None,
        registry: Registry | None = None,
        tenant: TenantResolver | None = None,
        lease: timedelta | None = None,
        retry: RetryPolicy | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        outbox_hooks: OutboxHooks | None = None,
        webhooks: str | None = "/webhooks",
        operations: str = "/operations",
        router: Router | None = None,
    ) -> None:
        for prefix in (webhooks, operations):
            if prefix is not None and (not prefix.startswith("/") or prefix.endswith("/")):
                raise ConfigurationError(f"a prefix starts with '/' and ends without: {prefix!r}")
        self.app = app
        self.routes = {
            (method.upper(), path): OperationRoute(spec) if isinstance(spec, str) else spec
            for (method, path), spec in routes.items()
        }
        self.providers, self.store, self._owns_store, registry = set_up(
            "PayorchMiddleware",
            providers=providers,
            url=url,
            store=store,
            from_url=AsyncStore.from_url,
            registry=registry,
            max_body=max_body,
            outbox_hooks=outbox_hooks,
        )
        if webhooks is not None:
            require_webhook_secrets(self.providers, "PayorchMiddleware(..., webhooks=None)")
        self.executor = AsyncExecutor(
            store=self.store,
            providers=self.providers,
            registry=registry,
            lease=lease,
            retry=retry,
            router=env_router(router),
        )
        self.webhooks = AsyncWebhookHandler(store=self.store, providers=self.providers)
        self.tenant: TenantResolver = tenant or header_tenant()
        self.max_body = max_body
        self.webhook_prefix = webhooks
        self.operation_prefix = operations
        self._closed = False
        self._closing = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] == "http" and await self._answered(scope, receive, send):
            return
        await self.app(scope, receive, send)

    # -- start-up and shutdown -------------------------------------------------------------

    async def startup(self) -> None:
        """The database check: reachable, a primary (its replication mode logged), migrated
        to this install's revision (``SchemaNotReady`` names ``payorch db upgrade``)."""
        # The pool's first connection, on the server's loop: payorch's schema must be this
        # install's (else the app would start and answer every payment 503).
        await self.store.check_schema()
        await self.store.check_replication()  # logged; strict mode refuses without sync

    async def shutdown(self) -> None:
        """Close the adapters' clients and the store, if it was opened here (once)."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        for adapter in self.providers:
            closing = getattr(adapter, "aclose", None)
            if closing is not None:
                await closing()
        if self._owns_store:
            await self.store.close()

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """payorch starts first and stops last; the app gets every event in between. An
        app that does not speak ``lifespan`` (it raises or returns at once) is left out."""
        first = await receive()  # lifespan.startup: the server's first message
        try:
            await self.startup()
        except Exception as exc:
            # A PayorchError is one line to act on (the upgrade hint); a traceback would hide it.
            trace = None if isinstance(exc, PayorchError) else exc
            log.error("payorch cannot start: %s", _reason(exc), exc_info=trace)
            await self.shutdown()
            message = f"payorch cannot start: {_reason(exc)}"  # the server prints it
            await send({"type": "lifespan.startup.failed", "message": message})
            return
        replayed = False

        async def inner_receive() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        async def inner_send(message: Message) -> None:
            if message["type"] in (
                "lifespan.startup.failed",
                "lifespan.shutdown.complete",
                "lifespan.shutdown.failed",
            ):
                await self.shutdown()  # the app is done with payorch: close it before saying so
            await send(message)

        try:
            await self.app(scope, inner_receive, inner_send)
        except Exception:
            if replayed:
                raise  # the app's own start-up or shutdown failed
        if not replayed:
            await self._alone(receive, send)

    async def _alone(self, receive: Receive, send: Send) -> None:
        """The lifespan without the app: started, then closed on shutdown."""
        await send({"type": "lifespan.startup.complete"})
        while True:  # the server sends shutdown, then waits for the answer
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- routing ---------------------------------------------------------------------------

    async def _answered(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Answer a request payorch owns; False: the app's."""
        path: str = scope["path"]
        root: str = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        method = str(scope["method"]).upper()
        route = self.routes.get((method, path))
        if route is not None:
            await self._run(route, scope, receive, send)
            return True
        parts = None if self.webhook_prefix is None else _under(path, self.webhook_prefix)
        if parts is not None and len(parts) == 2:
            if method not in _WEBHOOK_METHODS:
                await _send_answer(send, not_allowed(method, _WEBHOOK_METHODS))
            else:
                await self._webhook(parts[0], parts[1], scope, receive, send)
            return True
        parts = _under(path, self.operation_prefix)
        if parts is not None and len(parts) == 1:
            if method not in _OPERATION_METHODS:
                await _send_answer(send, not_allowed(method, _OPERATION_METHODS))
            else:
                await self._operation(parts[0], scope, send, head=method == "HEAD")
            return True
        return False

    async def _run(self, route: OperationRoute, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            tenant = known_tenant(await self._tenant(scope))
            lines = _header_lines(scope, IDEMPOTENCY_KEY_HEADER)
            # Two header lines are one list-valued field (RFC 9110): refused as a list.
            key = parse_idempotency_key(", ".join(lines) if lines else None)
            payload = parse_json_body(await self._body(scope, receive))
            outcome = await self.executor.execute(
                tenant_id=tenant,
                operation=route.operation,
                idempotency_key=key,
                request=payload,
                provider=route.provider,
                wait=route.wait,
            )
            where = f"{scope.get('root_path', '')}{self.operation_prefix}/{outcome.operation_id}"
            answer = http_answer(outcome, success_status=route.status_code, location=where)
        except _Gone:
            return
        except Exception as exc:  # noqa: BLE001 - every failure answers problem+json
            answer = failure(exc, log)
        await _send_answer(send, answer)

    async def _webhook(
        self, tenant: str, provider: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        try:
            body = await self._body(scope, receive)
            # Line by line, as FastAPI hands them over: the adapter sees what it would there.
            lines = scope.get("headers", ())
            headers = WebhookHeaders((k.decode("latin-1"), v.decode("latin-1")) for k, v in lines)
            result = await self.webhooks.handle_delivery(tenant, provider, headers, body)
            answer = webhook_answer(result)
        except _Gone:
            return
        except Exception as exc:  # noqa: BLE001 - a 5xx makes the provider re-send it
            answer = failure(exc, log, webhook_answer)
        await _send_answer(send, answer)

    async def _operation(self, operation_id: str, scope: Scope, send: Send, *, head: bool) -> None:
        try:
            tenant = known_tenant(await self._tenant(scope))
            record = await self.store.get(tenant, checked_operation_id(operation_id))
            answer = operation_answer(Outcome.from_record(record, replayed=False))
        except Exception as exc:  # noqa: BLE001 - every failure answers problem+json
            answer = failure(exc, log)
        await _send_answer(send, answer, head=head)

    async def _tenant(self, scope: Scope) -> str | None:
        found = self.tenant(scope)
        if inspect.isawaitable(found):
            found = await found
        return found

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        declared = _header_lines(scope, "content-length")
        if len(declared) == 1 and declared[0].isdigit() and int(declared[0]) > self.max_body:
            raise Refused(too_large(self.max_body))
        chunks = bytearray()
        while True:  # bounded: the body ends, passes max_body, or the client goes
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Gone
            chunks += message.get("body", b"")
            if len(chunks) > self.max_body:
                raise Refused(too_large(self.max_body))
            if not message.get("more_body", False):
                return bytes(chunks)


def _under(path: str, prefix: str) -> list[str] | None:
    """The non-empty segments of ``path`` below ``prefix``, or None if it is not below."""
    if not path.startswith(prefix + "/"):
        return None
    parts = path[len(prefix) + 1 :].split("/")
    return parts if all(parts) else None


def _reason(exc: BaseException) -> str:
    return exc.message if isinstance(exc, PayorchError) else f"{type(exc).__name__}: {exc}"
