"""Flask: one decorator gives a view idempotency. ``payorch[flask]`` (Flask 3).

::

    payorch = Payorch(providers=[SandboxProvider(...)], tenant=header_tenant("X-Tenant-Id"))
    app = Flask(__name__)
    payorch.init_app(app)  # checks the database: reachable, a primary, migrated
    app.register_blueprint(payorch.blueprint())  # POST /webhooks/<tenant>/<provider>,
                                                 # GET /operations/<operation_id>

    @app.post("/payments")
    @payorch.operation("payment.create", status_code=201)
    def create(op: Idempotent) -> Response:
        return op.run()  # 200/201, a replay, 202 + Location, 409, 422: payorch.http's table

The decorator resolves the tenant (from the request: a header, a URL variable, the
authenticated principal; never the body), parses the ``Idempotency-Key`` header and the JSON
body, and refuses bad input with an RFC 9457 problem before the view runs or anything is
written. The sync :class:`~payorch.Executor` runs in the server's worker thread. The same
contract as :mod:`payorch.integrations.fastapi`, for WSGI.
"""

from __future__ import annotations

import atexit
import functools
import io
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import IO, Any, TypeAlias

from flask import Blueprint, Flask, Request, Response, current_app, request, url_for
from flask.typing import ResponseReturnValue
from pydantic import BaseModel
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge
from werkzeug.routing import BuildError

from ..errors import ConfigurationError, InvalidTenant, PayorchError
from ..execution._executor import Executor, RetryPolicy
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
from ..provider import Provider
from ..reconciling._webhooks import WebhookHandler
from ..routing import Router
from ..storage._outbox import OutboxHooks
from ..storage._store import Store
from ._common import (
    DEFAULT_MAX_BODY,
    Refused,
    WebhookHeaders,
    checked_operation_id,
    env_router,
    failure,
    known_tenant,
    operation_answer,
    require_webhook_secrets,
    set_up,
    too_large,
)

__all__ = [
    "BLUEPRINT",
    "Idempotent",
    "Payorch",
    "TenantResolver",
    "header_tenant",
    "path_tenant",
]

log = logging.getLogger("payorch.flask")

# ``(request) -> tenant id``; ``None`` means "not authenticated" (401).
TenantResolver: TypeAlias = Callable[[Request], "str | None"]
BLUEPRINT = "payorch"  # the blueprint's name: its endpoints are payorch.webhook, payorch.operation
_OPERATION_ENDPOINT = f"{BLUEPRINT}.operation"
_READ_CHUNK = 64 * 1024


def header_tenant(name: str = "X-Tenant-Id") -> TenantResolver:
    """The tenant from header ``name``, set by a trusted gateway; missing or repeated: 400."""

    def tenant(req: Request) -> str:
        values = req.headers.getlist(name)
        if len(values) != 1 or not values[0].strip(" \t"):
            raise InvalidTenant(f"send exactly one non-empty {name} header")
        return values[0].strip(" \t")

    return tenant


def path_tenant(name: str = "tenant") -> TenantResolver:
    """The tenant from the URL variable ``name`` (``/t/<tenant>/payments``)."""

    def tenant(req: Request) -> str:
        value = (req.view_args or {}).get(name)
        if value is None:  # a rule without it: the app's mistake, not the client's
            raise ConfigurationError(f"the rule of {req.path!r} has no <{name}>")
        return str(value)

    return tenant


def _current() -> Request:
    # The request object itself, not the context-local proxy: an Idempotent may be kept.
    current: Request = request._get_current_object()  # type: ignore[attr-defined]  # a proxy
    return current


def _response(answer: HttpAnswer) -> Response:
    return Response(
        answer.content(),
        status=answer.status,
        headers=answer.headers,
        content_type=answer.content_type,
    )


def _failed(exc: Exception, mapped: Callable[[Any], HttpAnswer] = http_answer) -> Response:
    return _response(failure(exc, log, mapped))


# -- the decorator's product -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Spec:
    operation: str
    status_code: int
    provider: str | None
    wait: timedelta | None


@dataclass(frozen=True, kw_only=True)
class Idempotent:
    """One checked request for an operation: its tenant, key and JSON body.

    ``op.run()`` executes it (once per tenant, operation and key) and answers;
    ``op.execute()`` gives the :class:`~payorch.Outcome` (raising ``PayorchError``) for a
    view that answers itself, e.g. with ``op.answer(outcome)``.
    """

    tenant: str
    key: str
    payload: dict[str, Any]
    request: Request = field(repr=False)
    operation: str
    _spec: _Spec = field(repr=False)
    _payorch: Payorch = field(repr=False)

    def execute(self, request: Mapping[str, Any] | BaseModel | None = None) -> Outcome:
        """Execute ``request`` (default: the body as sent) under this tenant and key."""
        return self._payorch.executor.execute(
            tenant_id=self.tenant,
            operation=self.operation,
            idempotency_key=self.key,
            request=self.payload if request is None else request,
            provider=self._spec.provider,
            wait=self._spec.wait,
        )

    def run(self, request: Mapping[str, Any] | BaseModel | None = None) -> Response:
        """Execute and answer: every outcome and refusal as ``payorch.http`` maps it."""
        try:
            outcome = self.execute(request)
        except Exception as exc:  # noqa: BLE001 - every failure answers problem+json
            return _failed(exc)
        return self.answer(outcome)

    def answer(self, result: Outcome | PayorchError) -> Response:
        if isinstance(result, PayorchError):
            return _failed(result)
        where = _location(self.request, result.operation_id)
        answer = http_answer(result, success_status=self._spec.status_code, location=where)
        return _response(answer)


def _location(req: Request, operation_id: str) -> str | None:
    """Where the blueprint serves the operation, if the app registered it."""
    try:
        rules = list(current_app.url_map.iter_rules(_OPERATION_ENDPOINT))
    except KeyError:  # the app did not register the blueprint
        return None
    view_args = req.view_args or {}
    # Only the variables its rule names (e.g. a <tenant> in the prefix): any other
    # would be appended as a query string.
    values = {k: v for k, v in view_args.items() if k in rules[0].arguments}
    try:
        return url_for(_OPERATION_ENDPOINT, **values, operation_id=operation_id)
    except BuildError:
        return None


# -- the integration ---------------------------------------------------------------------------


class Payorch:
    """payorch for Flask apps: executor, webhook handler, view decorator, blueprint.

    ``url`` (default ``PAYORCH_DATABASE_URL``) or a :class:`~payorch.Store` of the app's own
    (then :meth:`close` leaves it open). The adapters need the sync API (``submit``).
    ``registry`` defaults to the built-in operations on the one provider. Configuration errors
    (a lease shorter than a provider call) surface here; the database is checked by
    :meth:`init_app` (given ``app``, at once).
    """

    def __init__(
        self,
        app: Flask | None = None,
        *,
        providers: Iterable[Provider],
        url: str | None = None,
        store: Store | None = None,
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
            from_url=Store.from_url,
            registry=registry,
            max_body=max_body,
            outbox_hooks=outbox_hooks,
        )
        self.executor = Executor(
            store=self.store,
            providers=self.providers,
            registry=registry,
            lease=lease,
            retry=retry,
            router=env_router(router),
        )
        self.webhooks = WebhookHandler(store=self.store, providers=self.providers)
        self.tenant: TenantResolver = tenant or header_tenant()
        self.max_body = max_body
        self._closed = False
        self._closing = threading.Lock()
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Check the database and attach to ``app`` (``app.extensions["payorch"]``).

        The check refuses to start against a database that is unreachable, a standby, or
        without payorch's schema at this install's revision (``SchemaNotReady``: run
        ``payorch db upgrade``). WSGI has no shutdown event: :meth:`close` runs at exit.
        """
        # The pool's first connection: payorch's schema must be this install's (else the app
        # would start and answer every payment 503).
        self.store.check_schema()
        self.store.replication.check()  # logged; strict mode refuses without a sync standby
        app.extensions[BLUEPRINT] = self
        atexit.register(self.close)

    def close(self) -> None:
        """Close the adapters' clients and the store, if it was opened here (once)."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        for adapter in self.providers:
            closing = getattr(adapter, "close", None)
            if closing is not None:
                closing()
        if self._owns_store:
            self.store.close()

    # -- the decorator ---------------------------------------------------------------------

    def operation(
        self,
        name: str,
        *,
        status_code: int = 200,
        provider: str | None = None,
        wait: timedelta | None = None,
    ) -> Callable[[Callable[..., ResponseReturnValue]], Callable[..., ResponseReturnValue]]:
        """Decorate a view to receive a checked :class:`Idempotent` for ``name``:
        ``view(op, **view_args)``, called once the tenant, the key and the body passed.

        ``status_code`` (200 or 201) answers success; ``provider`` picks an adapter other
        than the operation type's; ``wait`` lets a duplicate wait for the first, up to it.
        A ``PayorchError`` the view raises is answered as ``payorch.http`` maps it; an
        ``HTTPException`` (``abort(403)``) is Flask's to answer.
        """
        if status_code not in (200, 201):
            raise ConfigurationError(f"status_code must be 200 or 201, not {status_code}")
        spec = _Spec(operation=name, status_code=status_code, provider=provider, wait=wait)

        def decorate(
            view: Callable[..., ResponseReturnValue],
        ) -> Callable[..., ResponseReturnValue]:
            @functools.wraps(view)
            def checked(**view_args: Any) -> ResponseReturnValue:
                try:
                    return view(self._checked(spec), **view_args)
                except HTTPException:
                    raise  # the view refused the Flask way: its own status, its own handler
                except Exception as exc:  # noqa: BLE001 - every failure answers problem+json
                    return _failed(exc)

            return checked

        return decorate

    def endpoint(self, name: str, **options: Any) -> Callable[..., ResponseReturnValue]:
        """A view that executes the body as sent:
        ``app.add_url_rule("/payments", view_func=payorch.endpoint("payment.create"),
        methods=["POST"])`` (its endpoint name is ``payorch_payment_create``)."""

        def run(op: Idempotent, **_: Any) -> ResponseReturnValue:
            return op.run()

        run.__name__ = "payorch_" + name.replace(".", "_")
        return self.operation(name, **options)(run)

    def _checked(self, spec: _Spec) -> Idempotent:
        """The tenant, the key, then the body: each refusal a typed error, nothing written."""
        tenant = known_tenant(self.tenant(request))
        lines = request.headers.getlist(IDEMPOTENCY_KEY_HEADER)
        # Two header lines are one list-valued field (RFC 9110): refused as a list.
        key = parse_idempotency_key(", ".join(lines) if lines else None)
        payload = parse_json_body(self._body())
        return Idempotent(
            tenant=tenant,
            key=key,
            payload=payload,
            request=_current(),
            operation=spec.operation,
            _spec=spec,
            _payorch=self,
        )

    def _body(self) -> bytes:
        """The body, bounded by ``max_body``, read through Flask's cache: a ``before_request``
        hook that read it (``get_data``, ``get_json``) leaves it for us, and we for the view."""
        req = _current()
        declared = req.content_length
        if declared is not None and declared > self.max_body:
            raise Refused(too_large(self.max_body))
        try:
            if declared is None:
                # No length to bound the stream (chunked): read it within max_body here, and
                # let get_data cache what was read. One read before us left it empty and cached.
                req.stream = io.BytesIO(self._bounded(req.stream))
            # With a length, werkzeug's stream ends there (<= max_body): a bounded read.
            body = req.get_data(cache=True)
        except RequestEntityTooLarge:  # the app's own MAX_CONTENT_LENGTH, lower still
            raise Refused(too_large(current_app.config["MAX_CONTENT_LENGTH"])) from None
        if len(body) > self.max_body:  # a chunked body a hook read first, unbounded
            raise Refused(too_large(self.max_body))
        return body

    def _bounded(self, stream: IO[bytes]) -> bytes:
        chunks = bytearray()
        while True:  # bounded: the body ends, or passes max_body
            chunk = stream.read(_READ_CHUNK)
            if not chunk:
                return bytes(chunks)
            chunks += chunk
            if len(chunks) > self.max_body:
                raise Refused(too_large(self.max_body))

    # -- the blueprint ---------------------------------------------------------------------

    def blueprint(
        self, *, webhooks: str | None = "/webhooks", operations: str = "/operations"
    ) -> Blueprint:
        """``POST {webhooks}/<tenant>/<provider>`` (endpoint ``payorch.webhook``: the URL
        configured at the provider, one per tenant; the signature vouches for it) and
        ``GET {operations}/<operation_id>`` (``payorch.operation``: the tenant's own
        operations only, another's is 404; what a 201/202's ``Location`` names). A
        ``<tenant>`` may be part of ``operations`` (``"/t/<tenant>/operations"``).
        ``webhooks=None`` leaves the webhook route out; with one, an adapter built without
        its webhook secret is refused (``ConfigurationError``)."""
        bp = Blueprint(BLUEPRINT, __name__)
        if webhooks is not None:
            require_webhook_secrets(self.providers, "blueprint(webhooks=None)")
            bp.add_url_rule(
                f"{webhooks}/<tenant>/<provider>", "webhook", self._webhook, methods=["POST"]
            )
        bp.add_url_rule(f"{operations}/<operation_id>", "operation", self._operation)
        return bp

    def _webhook(self, tenant: str, provider: str) -> Response:
        try:
            body = self._body()
            # As FastAPI hands them over; a WSGI server has already joined a repeated
            # header's lines into one value (as RFC 9110 allows), so that is one line here.
            headers = WebhookHeaders(request.headers.items())
            result = self.webhooks.handle_delivery(tenant, provider, headers, body)
        except Exception as exc:  # noqa: BLE001 - a 5xx makes the provider re-send it
            return _failed(exc, webhook_answer)
        return _response(webhook_answer(result))

    def _operation(self, operation_id: str, **_: Any) -> Response:
        try:
            tenant = known_tenant(self.tenant(request))
            record = self.store.get(tenant, checked_operation_id(operation_id))
        except Exception as exc:  # noqa: BLE001 - every failure answers problem+json
            return _failed(exc)
        return _response(operation_answer(Outcome.from_record(record, replayed=False)))
