"""FastAPI / Starlette: one dependency gives an endpoint idempotency. ``payorch[fastapi]``.

::

    payorch = Payorch(providers=[SandboxProvider(...)], tenant=header_tenant("X-Tenant-Id"))
    app = FastAPI(lifespan=payorch.lifespan, exception_handlers=payorch.exception_handlers)
    app.include_router(payorch.router())  # POST /webhooks/{tenant}/{provider}, GET /operations/{id}

    @app.post("/payments")
    async def create(op: Annotated[Idempotent, Depends(payorch.operation("payment.create"))]):
        return await op.run()  # 200/201, a replay, 202 + Location, 409, 422: payorch.http's table

The dependency resolves the tenant (from the request: a header, a path parameter, the
authenticated principal; never the body), parses the ``Idempotency-Key`` header and the JSON
body, and refuses bad input with an RFC 9457 problem before anything is written. The
:class:`~payorch.AsyncExecutor` runs on the server's event loop (no thread pool); the
lifespan checks the database on start-up (reachable, a read-write primary, payorch's schema
at this install's revision, its replication mode logged) and closes the store and the
adapters' clients.
"""

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Annotated, Any, TypeAlias

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.routing import NoMatchFound
from starlette.types import ASGIApp

from ..core import State, validate_tenant
from ..errors import ConfigurationError, OperationNotFound, PayorchError, SchemaNotReady
from ..execution._async import AsyncExecutor
from ..execution._executor import RetryPolicy
from ..http import (
    IDEMPOTENCY_KEY_HEADER,
    SAME_KEY,
    HttpAnswer,
    http_answer,
    parse_idempotency_key,
    parse_json_body,
    problem,
    webhook_answer,
)
from ..operations import Registry
from ..outcome import Outcome
from ..provider import AsyncProvider
from ..reconciling._async import AsyncWebhookHandler
from ..routing import Router
from ..storage._async_store import AsyncStore
from ..storage._outbox import OutboxHooks
from ._common import env_router, require_webhook_secrets, set_up
from ._fastapi_tenants import TenantResolver, header_tenant, path_tenant, principal_tenant

__all__ = [
    "OPERATION_ROUTE",
    "WEBHOOK_ROUTE",
    "Idempotent",
    "Payorch",
    "TenantResolver",
    "header_tenant",
    "path_tenant",
    "principal_tenant",
]

log = logging.getLogger("payorch.fastapi")

Handler: TypeAlias = Callable[[Request, Any], Coroutine[Any, Any, Response]]

OPERATION_ROUTE = "payorch-operation"  # the route name a 201/202's Location is built from
WEBHOOK_ROUTE = "payorch-webhook"
DEFAULT_MAX_BODY = 1 << 20  # bytes; a payment request or a webhook is a few kilobytes
_UNRESOLVED = "urn:payorch:problem:tenant-unresolved"  # the same types as the Django views
_TOO_LARGE = "urn:payorch:problem:request-body-too-large"
_INTERNAL = "urn:payorch:problem:error"
_MAX_OPERATION_ID = 36  # payorch_operations.id


class _Refused(Exception):
    """A refusal the integration itself answers (401, 413): carries its problem answer."""

    def __init__(self, answer: HttpAnswer) -> None:
        super().__init__(answer.body.get("detail"))
        self.answer = answer


def _response(answer: HttpAnswer) -> Response:
    return Response(
        answer.content(),
        status_code=answer.status,
        headers=answer.headers,
        media_type=answer.content_type,
    )


def _failure(exc: Exception, mapped: Callable[[Any], HttpAnswer] = http_answer) -> Response:
    """Every failure as problem+json; the client gets a generic 5xx detail, the log the truth."""
    if isinstance(exc, _Refused):
        return _response(exc.answer)
    if isinstance(exc, PayorchError):
        if exc.http_status >= 500:
            # A schema to upgrade is one line to act on; a traceback would hide it.
            trace = None if isinstance(exc, SchemaNotReady) else exc
            log.error("payorch: %s", exc.message, exc_info=trace)
        return _response(mapped(exc))
    log.error("payorch: unexpected error", exc_info=exc)
    detail = "the server failed; retry with the same idempotency key later, never a new one"
    return _response(problem(500, _INTERNAL, "Error", detail, retry=SAME_KEY))


async def _handle(request: Request, exc: Exception) -> Response:
    return _failure(exc)


# -- the dependency's product ----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Spec:
    operation: str
    status_code: int
    provider: str | None
    wait: timedelta | None


@dataclass(frozen=True, kw_only=True)
class Idempotent:
    """One checked request for an operation: its tenant, key and JSON body.

    ``await op.run()`` executes it (once per tenant, operation and key) and answers;
    ``await op.execute()`` gives the :class:`~payorch.Outcome` (raising ``PayorchError``)
    for an endpoint that answers itself, e.g. with ``op.answer(outcome)``.
    """

    tenant: str
    key: str
    payload: dict[str, Any]
    request: Request = field(repr=False)
    operation: str
    _spec: _Spec = field(repr=False)
    _payorch: "Payorch" = field(repr=False)

    async def execute(self, request: Mapping[str, Any] | BaseModel | None = None) -> Outcome:
        """Execute ``request`` (default: the body as sent) under this tenant and key."""
        return await self._payorch.executor.execute(
            tenant_id=self.tenant,
            operation=self.operation,
            idempotency_key=self.key,
            request=self.payload if request is None else request,
            provider=self._spec.provider,
            wait=self._spec.wait,
        )

    async def run(self, request: Mapping[str, Any] | BaseModel | None = None) -> Response:
        """Execute and answer: every outcome and refusal as ``payorch.http`` maps it."""
        try:
            outcome = await self.execute(request)
        except Exception as exc:  # noqa: BLE001 - every failure answers problem+json
            return _failure(exc)
        return self.answer(outcome)

    def answer(self, result: Outcome | PayorchError) -> Response:
        if isinstance(result, PayorchError):
            return _failure(result)
        where = _location(self.request, result.operation_id)
        return _response(http_answer(result, success_status=self._spec.status_code, location=where))


def _location(request: Request, operation_id: str) -> str | None:
    """Where the operations router serves the operation, if the app mounted it."""
    router = request.scope.get("router")
    if router is None:
        return None
    for params in ({}, dict(request.path_params)):  # e.g. a {tenant} in the operations path
        try:
            path = router.url_path_for(OPERATION_ROUTE, **params, operation_id=operation_id)
        except NoMatchFound:
            continue
        return f"{request.scope.get('root_path', '')}{path}"
    return None


def _operation_answer(outcome: Outcome) -> Response:
    # The operation resource exists whatever its state: 200, the state is in the body.
    answer = http_answer(outcome)
    headers = {k: v for k, v in answer.headers.items() if k != "Retry-After"}
    if outcome.unknown or outcome.state is State.IN_PROGRESS:
        headers["Retry-After"] = "1"  # still moving: when to look again
    return _response(HttpAnswer(status=200, body=answer.body, headers=headers))


# -- the integration -------------------------------------------------------------------------


class Payorch:
    """payorch for one FastAPI (or Starlette) app: executor, webhooks, routes, lifespan.

    ``url`` (default ``PAYORCH_DATABASE_URL``) or an ``AsyncStore`` of the app's own (then it
    stays open after shutdown). The adapters must have the async API; the lifespan closes
    their clients. ``registry`` defaults to the built-in operations on the one provider.
    Configuration errors (a lease shorter than a provider call) surface here, at import.
    """

    def __init__(
        self,
        *,
        providers: Iterable[AsyncProvider],
        url: str | None = None,
        store: AsyncStore | None = None,
        registry: Registry | None = None,
        tenant: TenantResolver | None = None,
        lease: timedelta | None = None,
        retry: RetryPolicy | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        outbox_hooks: OutboxHooks | None = None,
        router: Router | None = None,
    ) -> None:
        self.providers, self.store, self._owns_store, registry = set_up(
            "Payorch",
            providers=providers,
            url=url,
            store=store,
            from_url=AsyncStore.from_url,
            registry=registry,
            max_body=max_body,
            outbox_hooks=outbox_hooks,
        )
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

    @property
    def exception_handlers(self) -> dict[int | type[Exception], Handler]:
        """``FastAPI(exception_handlers=...)``: payorch's refusals as problem+json."""
        return {PayorchError: _handle, _Refused: _handle}

    @contextlib.asynccontextmanager
    async def lifespan(self, app: ASGIApp) -> AsyncIterator[None]:
        """``FastAPI(lifespan=payorch.lifespan)``, or ``async with payorch.lifespan(app):``
        inside the app's own lifespan. Refuses to start without the exception handlers
        (a refusal would otherwise be a 500), without a reachable database, or on one whose
        payorch schema is not this install's (``SchemaNotReady``: run ``payorch db
        upgrade``)."""
        handlers = getattr(app, "exception_handlers", None)
        if isinstance(handlers, Mapping) and PayorchError not in handlers:
            raise ConfigurationError(
                "payorch's refusals need their handlers: "
                "FastAPI(..., exception_handlers=payorch.exception_handlers)"
            )
        try:
            try:
                # The pool's first connection, on the server's loop: payorch's schema must
                # be this install's (else the app would start and answer every payment 503).
                await self.store.check_schema()
            except PayorchError as exc:
                log.error("payorch cannot start: %s", exc.message)  # one line, then uvicorn's
                raise
            await self.store.check_replication()  # logged; strict mode refuses without sync
            yield
        finally:
            for adapter in self.providers:
                closing = getattr(adapter, "aclose", None)
                if closing is not None:
                    await closing()
            if self._owns_store:
                await self.store.close()

    # -- the dependency ------------------------------------------------------------------

    def operation(
        self,
        name: str,
        *,
        status_code: int = 200,
        provider: str | None = None,
        wait: timedelta | None = None,
    ) -> Callable[..., Awaitable[Idempotent]]:
        """A dependency giving the endpoint a checked :class:`Idempotent` for ``name``.

        ``status_code`` (200 or 201) answers success; ``provider`` picks an adapter other
        than the operation type's; ``wait`` lets a duplicate wait for the first, up to it.
        """
        if status_code not in (200, 201):
            raise ConfigurationError(f"status_code must be 200 or 201, not {status_code}")
        spec = _Spec(operation=name, status_code=status_code, provider=provider, wait=wait)
        key_doc = "the request's idempotency key: an sf-string (quoted) or bare"

        async def idempotent(
            request: Request,
            tenant: Annotated[str | None, Depends(self.tenant)],
            # Declared for the OpenAPI schema; every line of it is read below.
            _declared: Annotated[
                str | None, Header(alias=IDEMPOTENCY_KEY_HEADER, description=key_doc)
            ] = None,
        ) -> Idempotent:
            checked = _known_tenant(tenant)
            lines = request.headers.getlist(IDEMPOTENCY_KEY_HEADER)
            # Two header lines are one list-valued field (RFC 9110): refused as a list.
            key = parse_idempotency_key(", ".join(lines) if lines else None)
            payload = parse_json_body(await self._body(request))
            return Idempotent(
                tenant=checked,
                key=key,
                payload=payload,
                request=request,
                operation=name,
                _spec=spec,
                _payorch=self,
            )

        return idempotent

    def endpoint(self, name: str, **options: Any) -> Callable[..., Awaitable[Response]]:
        """An endpoint that executes the body as sent:
        ``app.add_api_route("/payments", payorch.endpoint("payment.create"), methods=["POST"])``.
        """
        dependency = self.operation(name, **options)

        async def run(op: Annotated[Idempotent, Depends(dependency)]) -> Response:
            return await op.run()

        return run

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            raise _Refused(self._too_large())
        chunks = bytearray()
        async for chunk in request.stream():  # bounded even without a Content-Length
            chunks += chunk
            if len(chunks) > self.max_body:
                raise _Refused(self._too_large())
        return bytes(chunks)

    def _too_large(self) -> HttpAnswer:
        detail = f"the request body is larger than {self.max_body} bytes"
        return problem(413, _TOO_LARGE, "Request body too large", detail)

    # -- routers ---------------------------------------------------------------------------

    def webhook_router(self, prefix: str = "/webhooks") -> APIRouter:
        """``POST {prefix}/{tenant}/{provider}``: the URL configured at the provider, one per
        tenant; the provider's signature vouches for it (no principal sends webhooks).
        Refuses (``ConfigurationError``) an adapter built without its webhook secret."""
        require_webhook_secrets(self.providers, "router(webhooks=None), or operations_router()")
        router = APIRouter(prefix=prefix, tags=["payorch"])

        @router.post("/{tenant}/{provider}", name=WEBHOOK_ROUTE, response_class=Response)
        async def webhook(request: Request, tenant: str, provider: str) -> Response:
            try:
                body = await self._body(request)
                result = await self.webhooks.handle_delivery(
                    tenant, provider, request.headers, body
                )
            except Exception as exc:  # noqa: BLE001 - a 5xx makes the provider re-send it
                return _failure(exc, webhook_answer)
            return _response(webhook_answer(result))

        return router

    def operations_router(self, prefix: str = "/operations") -> APIRouter:
        """``GET {prefix}/{operation_id}``, the tenant's own operations only (another's is
        404): what a 202's ``Location`` names. A ``{tenant}`` may be part of ``prefix``."""
        router = APIRouter(prefix=prefix, tags=["payorch"])

        @router.get("/{operation_id}", name=OPERATION_ROUTE, response_class=Response)
        async def operation(
            operation_id: str, tenant: Annotated[str | None, Depends(self.tenant)]
        ) -> Response:
            checked = _known_tenant(tenant)
            if len(operation_id) > _MAX_OPERATION_ID or not operation_id.isprintable():
                raise OperationNotFound(f"no operation {operation_id[:_MAX_OPERATION_ID]!r}")
            record = await self.store.get(checked, operation_id)
            return _operation_answer(Outcome.from_record(record, replayed=False))

        return router

    def router(
        self, *, webhooks: str | None = "/webhooks", operations: str = "/operations"
    ) -> APIRouter:
        """Both routers: ``app.include_router(payorch.router())``; ``webhooks=None`` leaves
        the webhook route out (for adapters that take no webhooks)."""
        router = APIRouter()
        if webhooks is not None:
            router.include_router(self.webhook_router(webhooks))
        router.include_router(self.operations_router(operations))
        return router


def _known_tenant(tenant: str | None) -> str:
    if tenant is None:
        detail = "this request carries no tenant: authenticate first"
        raise _Refused(problem(401, _UNRESOLVED, "Tenant unresolved", detail))
    return validate_tenant(tenant)
