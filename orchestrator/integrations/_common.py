"""What the Flask integration and the ASGI middleware answer alike, framework-free.

The answers themselves are :mod:`payorch.http`'s; this holds the integrations' own
refusals (401, 405, 413, 500), the operation resource's answer and the logging of failures,
so that both speak with the same problem types as the FastAPI and Django integrations; the
set-up the FastAPI, Flask and ASGI integrations share (:func:`set_up`); and the refusal of a
webhook route for an adapter that cannot verify a delivery (:func:`require_webhook_secrets`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, ItemsView, Iterable, Iterator, Mapping, ValuesView
from typing import Any, Protocol, TypeVar

from ..core import State, validate_tenant
from ..errors import ConfigurationError, OperationNotFound, PayorchError, SchemaNotReady
from ..http import SAME_KEY, HttpAnswer, http_answer, problem
from ..operations import Registry, default_registry
from ..outcome import Outcome
from ..routing import Router, load_router
from ..settings import Settings
from ..storage._outbox import OutboxHooks, load_hooks

__all__ = [
    "DEFAULT_MAX_BODY",
    "Refused",
    "WebhookHeaders",
    "checked_operation_id",
    "env_router",
    "failure",
    "known_tenant",
    "missing_webhook_secret",
    "not_allowed",
    "operation_answer",
    "require_webhook_secrets",
    "set_up",
    "too_large",
    "unresolved",
]

DEFAULT_MAX_BODY = 1 << 20  # bytes; a payment request or a webhook is a few kilobytes
_UNRESOLVED = "urn:payorch:problem:tenant-unresolved"  # the FastAPI and Django types
_NOT_ALLOWED = "urn:payorch:problem:method-not-allowed"
_TOO_LARGE = "urn:payorch:problem:request-body-too-large"
_INTERNAL = "urn:payorch:problem:error"
_MAX_OPERATION_ID = 36  # payorch_operations.id
_INTERNAL_DETAIL = "the server failed; retry with the same idempotency key later, never a new one"


class _Named(Protocol):
    @property
    def name(self) -> str: ...


P = TypeVar("P", bound=_Named)
S = TypeVar("S")


def set_up(
    owner: str,
    *,
    providers: Iterable[P],
    url: str | None,
    store: S | None,
    from_url: Callable[..., S],
    registry: Registry | None,
    max_body: int,
    outbox_hooks: OutboxHooks | None,
) -> tuple[list[P], S, bool, Registry]:
    """An integration's adapters, store (and whether it opened it) and registry, refused in
    one line when misconfigured. ``url`` defaults to ``PAYORCH_DATABASE_URL`` and the hooks to
    ``PAYORCH_OUTBOX_HOOKS``; a store of the app's own brings its own hooks. The registry
    defaults to the built-in operations, on the provider when there is just one."""
    if url is not None and store is not None:
        raise ConfigurationError(f"give {owner} a database url or a store, not both")
    if max_body < 1:
        raise ConfigurationError("max_body must be positive")
    adapters = list(providers)
    if not adapters:
        raise ConfigurationError(f"{owner} needs at least one provider adapter")
    owned = store is None
    if store is None:
        config = Settings()
        if outbox_hooks is None and config.outbox_hooks:
            outbox_hooks = load_hooks(config.outbox_hooks)
        store = from_url(url or config.database_url, outbox_hooks=outbox_hooks)
    elif outbox_hooks is not None:
        kind = type(store).__name__
        raise ConfigurationError(f"give the store its outbox_hooks ({kind}(..., outbox_hooks=))")
    if registry is None:
        registry = default_registry(adapters[0].name if len(adapters) == 1 else None)
    return adapters, store, owned, registry


def env_router(router: Router | None = None) -> Router | None:
    """``router``, else the routing table ``PAYORCH_ROUTING`` names (None: nothing routed);
    a table that cannot be read is refused in one line, as the executor refuses a rule that
    cannot route."""
    if router is not None:
        return router
    path = Settings().routing
    return load_router(path) if path else None


# What payorch's adapters call their webhook secret, to name it in the refusal below.
_SECRET_PARAMETERS = ("webhook_secret", "hmac_key")


def missing_webhook_secret(adapter: object, instead: str) -> str | None:
    """Why a webhook route must not serve ``adapter``, in one line, or None if it may.

    An adapter says whether it can verify a delivery with ``verifies_webhooks`` (False when
    it was built without its webhook secret); one without the attribute is taken to verify.
    Served anyway, every delivery would fail verification and be answered 500, which the
    provider re-sends for days. ``instead`` says how to serve no webhook route."""
    if getattr(adapter, "verifies_webhooks", True):
        return None
    kind = type(adapter).__name__
    try:
        accepted = set(inspect.signature(type(adapter)).parameters)
    except (TypeError, ValueError):  # a constructor inspect cannot read: name no parameter
        accepted = set()
    secret = next((f"{kind}({p}=...)" for p in _SECRET_PARAMETERS if p in accepted), None)
    name = getattr(adapter, "name", kind)
    return (
        f"cannot serve webhooks for provider {name!r}: its adapter has no webhook secret, so "
        f"every delivery would fail verification; build it with one"
        f"{f' ({secret})' if secret else ''} or serve no webhook route ({instead})"
    )


def require_webhook_secrets(adapters: Iterable[object], instead: str) -> None:
    """Refuse (:class:`ConfigurationError`) a webhook route for an adapter that cannot verify
    a delivery: see :func:`missing_webhook_secret`."""
    for adapter in adapters:
        refusal = missing_webhook_secret(adapter, instead)
        if refusal is not None:
            raise ConfigurationError(refusal)


def unresolved() -> HttpAnswer:
    detail = "this request carries no tenant: authenticate first"
    return problem(401, _UNRESOLVED, "Tenant unresolved", detail)


def too_large(max_body: int) -> HttpAnswer:
    detail = f"the request body is larger than {max_body} bytes; send a smaller one"
    return problem(413, _TOO_LARGE, "Request body too large", detail)


def not_allowed(method: str, allowed: tuple[str, ...]) -> HttpAnswer:
    detail = f"{method} is not allowed here; use {', '.join(allowed)}"
    headers = {"Allow": ", ".join(allowed)}
    return problem(405, _NOT_ALLOWED, "Method not allowed", detail, headers=headers)


def known_tenant(tenant: str | None) -> str:
    """The resolved tenant, validated; ``None`` (not authenticated) raises :class:`Refused`."""
    if tenant is None:
        raise Refused(unresolved())
    return validate_tenant(tenant)


def checked_operation_id(operation_id: str) -> str:
    # An id no row can hold finds nothing, and must not reach the database as it is.
    if len(operation_id) > _MAX_OPERATION_ID or not operation_id.isprintable():
        raise OperationNotFound(f"no operation {operation_id[:_MAX_OPERATION_ID]!r}")
    return operation_id


class Refused(Exception):
    """A refusal the integration answers itself (401, 413): carries its problem answer."""

    def __init__(self, answer: HttpAnswer) -> None:
        super().__init__(answer.body.get("detail"))
        self.answer = answer


def failure(
    exc: BaseException,
    log: logging.Logger,
    mapped: Callable[[Any], HttpAnswer] = http_answer,
) -> HttpAnswer:
    """Every failure as problem+json; the client gets a generic 5xx detail, the log the truth."""
    if isinstance(exc, Refused):
        return exc.answer
    if isinstance(exc, PayorchError):
        if exc.http_status >= 500:
            # A schema to upgrade is one line to act on; a traceback would hide it.
            trace = None if isinstance(exc, SchemaNotReady) else exc
            log.error("payorch: %s", exc.message, exc_info=trace)
        return mapped(exc)
    log.error("payorch: unexpected error", exc_info=exc)
    return problem(500, _INTERNAL, "Error", _INTERNAL_DETAIL, retry=SAME_KEY)


def operation_answer(outcome: Outcome) -> HttpAnswer:
    """The operation resource: 200 whatever its state (the state is in the body), with
    ``Retry-After: 1`` while it is still moving (in progress or unknown)."""
    answer = http_answer(outcome)
    headers = {k: v for k, v in answer.headers.items() if k != "Retry-After"}
    if outcome.unknown or outcome.state is State.IN_PROGRESS:
        headers["Retry-After"] = "1"
    return HttpAnswer(status=200, body=answer.body, headers=headers)


class WebhookHeaders(Mapping[str, str]):
    """A webhook's header lines as the FastAPI integration hands them to the adapters
    (Starlette's ``Headers``), so that every integration gets one answer for one delivery.

    Names are lower-cased and every line is kept, in order: ``headers[name]`` and ``get`` give
    the first line of ``name`` (any case), ``getlist`` all of them; ``items()``, ``keys()``,
    ``values()``, iteration and ``len`` go line by line, a repeated name each time.
    """

    def __init__(self, lines: Iterable[tuple[str, str]]) -> None:
        self._lines = [(name.lower(), value) for name, value in lines]

    def __getitem__(self, name: str) -> str:
        wanted = name.lower()
        for key, value in self._lines:
            if key == wanted:
                return value
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and any(k == name.lower() for k, _ in self._lines)

    def __iter__(self) -> Iterator[str]:
        return iter([key for key, _ in self._lines])

    def __len__(self) -> int:
        return len(self._lines)

    def items(self) -> _Lines:  # every line: a dict built from it keeps a name's last line
        return _Lines(self)

    def values(self) -> _Values:
        return _Values(self)

    def getlist(self, name: str) -> list[str]:
        wanted = name.lower()
        return [value for key, value in self._lines if key == wanted]

    def __repr__(self) -> str:
        return f"WebhookHeaders({self._lines!r})"


class _Lines(ItemsView[str, str]):
    _mapping: WebhookHeaders

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(list(self._mapping._lines))

    def __contains__(self, item: object) -> bool:
        return item in self._mapping._lines


class _Values(ValuesView[str]):
    _mapping: WebhookHeaders

    def __iter__(self) -> Iterator[str]:
        return iter([value for _, value in self._mapping._lines])
