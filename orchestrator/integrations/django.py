"""Django: ``@idempotent`` views (sync and async), webhook and operation views, settings.

Install ``payorch[django]``. Configure in the project's settings::

    PAYORCH = {
        "DATABASE_URL": "sqlite:///payorch.db",     # default: PAYORCH_DATABASE_URL
        "PROVIDERS": "myshop.payments.providers",   # a list, a callable or its dotted path
        "TENANT": "header:X-Tenant-Id",             # | "kwarg:tenant" | "user[:attr]" | callable
    }

then decorate a view; the decorator parses the ``Idempotency-Key`` header and the JSON body,
resolves the tenant, runs ``execute()`` and answers with what :func:`payorch.http.http_answer`
says (the view only shapes the request, or is left out: :func:`idempotent_view`)::

    @idempotent("payment.create", status=201)
    def create_payment(request, payload):
        return {**payload, "customer": f"cus_{request.user.pk}"}

An ``async def`` view runs on the :class:`~payorch.AsyncExecutor` (under ASGI); a plain one
on the :class:`~payorch.Executor`. Both are built once, lazily, from ``settings.PAYORCH``.
Every refusal is an RFC 9457 ``application/problem+json`` answer; nothing is written.
On first use each runtime checks payorch's schema (``Store.check_schema``): until
``payorch db upgrade`` has run, every request answers 503 ``schema-not-ready`` and logs
the command to run (one check at a time; the others answer the last refusal at once).
``urls()`` serves ``readyz`` for a readiness probe, and :class:`PayorchAppConfig` (in
``INSTALLED_APPS``) makes ``manage.py check --database default`` fail on such a schema.
The tenant always comes from the request (header, path, principal), never from the body.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeAlias, cast

from django.core.exceptions import (
    BadRequest,
    PermissionDenied,
    RequestDataTooBig,
    SuspiciousOperation,
)
from django.http import Http404, HttpRequest, HttpResponse
from django.urls import NoReverseMatch, URLPattern, path, reverse
from django.views.decorators.csrf import csrf_exempt

from ..core import State, validate_tenant
from ..errors import ConfigurationError, PayorchError, SchemaNotReady
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
from ..outcome import Outcome
from ._common import checked_operation_id
from ._django_config import (
    PayorchAppConfig,
    PayorchConfig,
    Tenant,
    async_executor,
    async_store,
    async_tenant,
    async_webhook_handler,
    checked_async,
    close,
    config,
    executor,
    require_asgi,
    store,
    tenant_resolver,
    webhook_handler,
)

__all__ = [
    "PayorchAppConfig",
    "PayorchConfig",
    "Tenant",
    "async_executor",
    "async_operation_view",
    "async_webhook_handler",
    "async_webhook_view",
    "close",
    "executor",
    "idempotent",
    "idempotent_view",
    "operation_view",
    "tenant_resolver",
    "urls",
    "webhook_handler",
    "webhook_view",
]

log = logging.getLogger("payorch.django")

Shaped: TypeAlias = "Mapping[str, Any] | HttpResponse | None"
_UNRESOLVED = "urn:payorch:problem:tenant-unresolved"
_NOT_ALLOWED = "urn:payorch:problem:method-not-allowed"
_TOO_LARGE = "urn:payorch:problem:request-body-too-large"
_INTERNAL = "urn:payorch:problem:error"
# Django's own refusals, raised by a view (or what it calls) before execute(): each keeps
# its status, as Django would answer it. payorch has not looked at the key, so it cannot
# say whether an earlier request with it ran (a retry of a paid order may meet a 404 now),
# and must not look (a 403 would show the caller another's outcome): it says what is true.
_NOT_LOOKED = (
    "the application refused this request before payorch looked at its idempotency key, so "
    "this request started nothing; an earlier request with the same key may have run"
)
_SAME_KEY_AGAIN = (
    "retry the same key, or GET the operation; never use a new key for the same payment"
)
_REFUSALS: tuple[tuple[type[Exception], int, str, str, str, int], ...] = (
    (
        PermissionDenied,
        403,
        "urn:payorch:problem:permission-denied",
        "Permission denied",
        f"the request is not allowed; {_NOT_LOOKED}: fix the request or its permission, "
        f"then {_SAME_KEY_AGAIN}",
        logging.INFO,
    ),
    (
        Http404,
        404,
        "urn:payorch:problem:not-found",
        "Not found",
        f"what the request names does not exist (now); {_NOT_LOOKED}: fix the request, "
        f"then {_SAME_KEY_AGAIN}",
        logging.INFO,
    ),
    (
        # DisallowedHost, TooManyFieldsSent, …: Django answers them 400 too.
        SuspiciousOperation,
        400,
        "urn:payorch:problem:suspicious-request",
        "Suspicious request",
        "the request was refused as suspicious (its host, headers or fields); "
        f"{_NOT_LOOKED}: fix the request, then {_SAME_KEY_AGAIN}",
        logging.WARNING,
    ),
    (
        BadRequest,
        400,
        "urn:payorch:problem:bad-request",
        "Bad request",
        f"the request was refused as malformed; {_NOT_LOOKED}: fix the request, then "
        f"{_SAME_KEY_AGAIN}",
        logging.INFO,
    ),
)


# -- answers ---------------------------------------------------------------------------------


def _response(answer: HttpAnswer) -> HttpResponse:
    response = HttpResponse(
        answer.content(), status=answer.status, content_type=answer.content_type
    )
    for name, value in answer.headers.items():
        response[name] = value
    return response


def _security(exc: SuspiciousOperation, request: HttpRequest, status: int) -> None:
    # Django's convention (django.core.handlers.exception): every SuspiciousOperation goes
    # to django.security.<class> at ERROR, where a project's alerting listens for it.
    name = f"django.security.{type(exc).__name__}"
    extra = {"status_code": status, "request": request}
    logging.getLogger(name).error(str(exc), exc_info=exc, extra=extra)


def _failure(
    exc: Exception,
    request: HttpRequest,
    mapped: Callable[[Any], HttpAnswer] = http_answer,
) -> HttpAnswer:
    if isinstance(exc, SuspiciousOperation):
        _security(exc, request, 413 if isinstance(exc, RequestDataTooBig) else 400)
    if isinstance(exc, PayorchError):
        if exc.http_status >= 500:  # the client gets a generic detail; the logs the truth
            # A schema to upgrade is one line to act on; a traceback would hide it.
            trace = None if isinstance(exc, SchemaNotReady) else exc
            log.error("payorch: %s", exc.message, exc_info=trace)
        return mapped(exc)
    if isinstance(exc, RequestDataTooBig):  # a SuspiciousOperation too, with its own status
        return problem(413, _TOO_LARGE, "Request body too large", "the request body is too large")
    for kind, status, type_, title, detail, level in _REFUSALS:
        if isinstance(exc, kind):
            log.log(level, "payorch: the view refused the request (%s)", type(exc).__name__)
            return problem(status, type_, title, detail)
    log.exception("payorch: unexpected error")
    detail = "the server failed; retry with the same idempotency key later, never a new one"
    return problem(500, _INTERNAL, "Error", detail, retry=SAME_KEY)


def _unresolved() -> HttpResponse:
    detail = "this request carries no tenant: authenticate first"
    return _response(problem(401, _UNRESOLVED, "Tenant unresolved", detail))


def _not_allowed(request: HttpRequest, allowed: tuple[str, ...]) -> HttpResponse | None:
    if request.method in allowed:
        return None
    detail = f"{request.method} is not allowed here; use {', '.join(allowed)}"
    headers = {"Allow": ", ".join(allowed)}
    return _response(problem(405, _NOT_ALLOWED, "Method not allowed", detail, headers=headers))


def _location(request: HttpRequest, name: str | None, outcome: Outcome) -> str | None:
    if name is None:
        return None
    match = request.resolver_match
    for kwargs in ({}, dict(match.kwargs) if match is not None else {}):
        try:
            return str(reverse(name, kwargs={**kwargs, "operation_id": outcome.operation_id}))
        except NoReverseMatch:
            continue
    return None


# -- the decorator ---------------------------------------------------------------------------

SyncShape = Callable[..., Shaped]
AsyncShape = Callable[..., Awaitable[Shaped]]


@dataclass(frozen=True, kw_only=True)
class _Spec:
    operation: str
    status: int
    provider: str | None
    wait: timedelta | None
    methods: tuple[str, ...]

    def parse(self, request: HttpRequest) -> tuple[str, dict[str, Any]]:
        """The key, then the body: each refusal a typed error, nothing written."""
        key = parse_idempotency_key(request.headers.get(IDEMPOTENCY_KEY_HEADER))
        return key, parse_json_body(request.body)

    def answer(self, request: HttpRequest, outcome: Outcome) -> HttpResponse:
        where = _location(request, config().operation_url, outcome)
        return _response(http_answer(outcome, success_status=self.status, location=where))


def idempotent(
    operation: str,
    *,
    status: int = 200,
    provider: str | None = None,
    wait: timedelta | None = None,
    methods: Iterable[str] = ("POST",),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make a view run ``operation`` once per ``Idempotency-Key`` and tenant.

    The view is called as ``view(request, payload, *args, **kwargs)`` with the parsed JSON
    body, after the key, the tenant and the body were checked. It returns the request to
    execute (a mapping or a pydantic model; ``None`` means the payload as it is) or an
    ``HttpResponse`` of its own (then nothing is executed). It may raise a ``PayorchError``
    (e.g. ``RequestValidationFailed``) to refuse, or refuse the Django way:
    ``PermissionDenied`` (403), ``Http404`` (404), ``SuspiciousOperation`` and its
    subclasses, ``BadRequest`` (400), each answered as problem+json, logged below ERROR
    (a ``SuspiciousOperation`` also to ``django.security.<class>`` at ERROR, as Django
    does), with nothing executed and the key not looked at: the detail says an earlier
    request with the same key may have run, and to retry that key. An ``async def`` view
    runs on the ``AsyncExecutor``. The view is CSRF-exempt: it needs the ``Idempotency-Key`` header,
    which a cross-site form cannot send and a cross-site script cannot without CORS consent.
    """
    if status not in (200, 201):
        raise ConfigurationError(f"status must be 200 or 201, not {status}")
    spec = _Spec(
        operation=operation,
        status=status,
        provider=provider,
        wait=wait,
        methods=tuple(m.upper() for m in methods),
    )

    def decorate(view: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(view):
            wrapped: Callable[..., Any] = _async_view(spec, view)
        else:
            wrapped = _sync_view(spec, view)
        return cast(Callable[..., Any], csrf_exempt(functools.wraps(view)(wrapped)))

    return decorate


def idempotent_view(
    operation: str, *, asynchronous: bool = False, **options: Any
) -> Callable[..., Any]:
    """A view that executes the JSON body as it is: ``path("payments", idempotent_view(...))``."""
    if asynchronous:

        async def as_is_async(request: HttpRequest, payload: dict[str, Any], **_: Any) -> Shaped:
            return payload

        return idempotent(operation, **options)(as_is_async)

    def as_is(request: HttpRequest, payload: dict[str, Any], **_: Any) -> Shaped:
        return payload

    return idempotent(operation, **options)(as_is)


def _sync_view(spec: _Spec, view: SyncShape) -> Callable[..., HttpResponse]:
    def run(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        refused = _not_allowed(request, spec.methods)
        if refused is not None:
            return refused
        try:
            tenant = config().tenant(request)
            if tenant is None:
                return _unresolved()
            key, payload = spec.parse(request)
            shaped = view(request, payload, *args, **kwargs)
            if isinstance(shaped, HttpResponse):
                return shaped
            outcome = executor().execute(
                tenant_id=validate_tenant(tenant),
                operation=spec.operation,
                idempotency_key=key,
                request=payload if shaped is None else shaped,
                provider=spec.provider,
                wait=spec.wait,
            )
            return spec.answer(request, outcome)
        except Exception as exc:  # noqa: BLE001 - every failure answers problem+json
            return _response(_failure(exc, request))

    return run


def _async_view(spec: _Spec, view: AsyncShape) -> Callable[..., Awaitable[HttpResponse]]:
    async def run(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        refused = _not_allowed(request, spec.methods)
        if refused is not None:
            return refused
        try:
            tenant = await async_tenant(request)
            if tenant is None:
                return _unresolved()
            key, payload = spec.parse(request)  # the body is read before the view is called
            shaped = await view(request, payload, *args, **kwargs)
            if isinstance(shaped, HttpResponse):
                return shaped
            await checked_async()
            outcome = await async_executor().execute(
                tenant_id=validate_tenant(tenant),
                operation=spec.operation,
                idempotency_key=key,
                request=payload if shaped is None else shaped,
                provider=spec.provider,
                wait=spec.wait,
            )
            return spec.answer(request, outcome)
        except Exception as exc:  # noqa: BLE001 - every failure answers problem+json
            return _response(_failure(exc, request))

    return run


# -- webhooks and operations ---------------------------------------------------------------


def _webhook_refusal(request: HttpRequest) -> HttpResponse | None:
    return _not_allowed(request, ("POST",))


def _sync_webhook(request: HttpRequest, tenant: str, provider: str) -> HttpResponse:
    refused = _webhook_refusal(request)
    if refused is not None:
        return refused
    try:
        headers = dict(request.headers.items())
        result = webhook_handler().handle_delivery(tenant, provider, headers, request.body)
    except Exception as exc:  # noqa: BLE001 - a 5xx makes the provider re-send it
        return _response(_failure(exc, request, webhook_answer))
    return _response(webhook_answer(result))


async def _async_webhook(request: HttpRequest, tenant: str, provider: str) -> HttpResponse:
    refused = _webhook_refusal(request)
    if refused is not None:
        return refused
    try:
        require_asgi(request)
        headers = dict(request.headers.items())
        await checked_async()
        result = await async_webhook_handler().handle_delivery(
            tenant, provider, headers, request.body
        )
    except Exception as exc:  # noqa: BLE001 - a 5xx makes the provider re-send it
        return _response(_failure(exc, request, webhook_answer))
    return _response(webhook_answer(result))


# A provider signs its webhooks; it holds no CSRF token. The tenant is the URL's (the
# endpoint configured at the provider for that tenant), and the signature vouches for it.
webhook_view: Callable[..., HttpResponse] = csrf_exempt(_sync_webhook)
async_webhook_view: Callable[..., Awaitable[HttpResponse]] = csrf_exempt(_async_webhook)


def _operation_answer(outcome: Outcome) -> HttpResponse:
    # The operation resource exists whatever its state: 200, the state is in the body.
    answer = http_answer(outcome)
    headers = {k: v for k, v in answer.headers.items() if k != "Retry-After"}
    if outcome.unknown or outcome.state is State.IN_PROGRESS:
        headers["Retry-After"] = "1"  # still moving: when to poll again
    return _response(HttpAnswer(status=200, body=answer.body, headers=headers))


def _sync_operation(request: HttpRequest, operation_id: str, **_: Any) -> HttpResponse:
    refused = _not_allowed(request, ("GET", "HEAD"))
    if refused is not None:
        return refused
    try:
        tenant = config().tenant(request)
        if tenant is None:
            return _unresolved()
        # An id no row can hold (a NUL, a lone surrogate, too long) is not found, as in the
        # other integrations, before the store is touched: the database may refuse it (503).
        wanted = checked_operation_id(operation_id)
        record = store().get(validate_tenant(tenant), wanted)
    except Exception as exc:  # noqa: BLE001 - every failure answers problem+json
        return _response(_failure(exc, request))
    return _operation_answer(Outcome.from_record(record, replayed=False))


async def _async_operation(request: HttpRequest, operation_id: str, **_: Any) -> HttpResponse:
    refused = _not_allowed(request, ("GET", "HEAD"))
    if refused is not None:
        return refused
    try:
        tenant = await async_tenant(request)
        if tenant is None:
            return _unresolved()
        wanted = checked_operation_id(operation_id)  # as the sync view, before the store
        await checked_async()
        record = await async_store().get(validate_tenant(tenant), wanted)
    except Exception as exc:  # noqa: BLE001 - every failure answers problem+json
        return _response(_failure(exc, request))
    return _operation_answer(Outcome.from_record(record, replayed=False))


operation_view: Callable[..., HttpResponse] = _sync_operation
async_operation_view: Callable[..., Awaitable[HttpResponse]] = _async_operation


# -- readiness -------------------------------------------------------------------------------


def _uncached(response: HttpResponse) -> HttpResponse:
    response["Cache-Control"] = "no-store"  # a probe must see now, never a cached answer
    return response


def _ready() -> HttpResponse:
    return _uncached(_response(HttpAnswer(status=200, body={"status": "ready"})))


def _sync_readyz(request: HttpRequest) -> HttpResponse:
    refused = _not_allowed(request, ("GET", "HEAD"))
    if refused is not None:
        return _uncached(refused)
    try:
        # store() runs the runtime's first check; then one read per probe, so a database
        # gone (or downgraded) since answers 503 too.
        store().check_schema()
    except Exception as exc:  # noqa: BLE001 - every failure answers problem+json
        return _uncached(_response(_failure(exc, request)))
    return _ready()


async def _async_readyz(request: HttpRequest) -> HttpResponse:
    refused = _not_allowed(request, ("GET", "HEAD"))
    if refused is not None:
        return _uncached(refused)
    try:
        require_asgi(request)
        await checked_async()
        await async_store().check_schema()
    except Exception as exc:  # noqa: BLE001 - every failure answers problem+json
        return _uncached(_response(_failure(exc, request)))
    return _ready()


def urls(*, asynchronous: bool = False) -> list[URLPattern]:
    """``webhooks/<tenant>/<provider>``, ``operations/<operation_id>`` (tenant-scoped) and
    ``readyz`` (200 ``{"status": "ready"}`` once payorch's schema check passes, else 503
    problem+json; never cached): ``path("payorch/", include(urls()))``. The operation URL
    is what a 202's Location names.
    """
    webhook = async_webhook_view if asynchronous else webhook_view
    operation = async_operation_view if asynchronous else operation_view
    readyz = _async_readyz if asynchronous else _sync_readyz
    return [
        path("webhooks/<str:tenant>/<str:provider>", webhook, name="payorch-webhook"),
        path("operations/<str:operation_id>", operation, name="payorch-operation"),
        path("readyz", readyz, name="payorch-readyz"),
    ]
