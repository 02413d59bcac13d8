"""Django settings for payorch (``settings.PAYORCH``), tenant resolvers, and what is built
once per process from them: the executors, the webhook handlers and their stores.

Imported by :mod:`payorch.integrations.django`, which re-exports the public names.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

from asgiref.sync import sync_to_async
from django.apps import AppConfig
from django.conf import settings as django_settings
from django.core import checks
from django.core.handlers.asgi import ASGIRequest
from django.core.signals import setting_changed
from django.http import HttpRequest
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils.module_loading import import_string

from ..errors import ConfigurationError, InvalidTenant, PayorchError, SchemaNotReady
from ..execution._async import AsyncExecutor
from ..execution._executor import Executor
from ..forks import reset_in_child
from ..operations import Registry, default_registry
from ..provider import AsyncProvider, Provider
from ..reconciling._async import AsyncWebhookHandler
from ..reconciling._webhooks import WebhookHandler
from ..settings import Settings
from ..storage._async_store import AsyncStore
from ..storage._outbox import OutboxHooks, load_hooks
from ..storage._store import Store
from ._common import env_router, missing_webhook_secret

__all__ = [
    "PayorchAppConfig",
    "PayorchConfig",
    "Tenant",
    "async_executor",
    "async_store",
    "async_tenant",
    "async_webhook_handler",
    "checked_async",
    "close",
    "config",
    "executor",
    "require_asgi",
    "schema_check",
    "store",
    "tenant_resolver",
    "webhook_handler",
    "webhook_secrets_check",
]

Tenant = Callable[[HttpRequest], "str | None"]
_KEYS = {  # unknown keys are refused: a typo would be silent
    "DATABASE_URL",
    "OUTBOX_HOOKS",
    "PROVIDERS",
    "REGISTRY",
    "TENANT",
    "LEASE_SECONDS",
    "OPERATION_URL",
}

# -- settings ------------------------------------------------------------------------------


def _load(value: Any, what: str) -> Any:
    """A dotted path is imported; anything else is taken as it is."""
    if not isinstance(value, str):
        return value
    try:
        return import_string(value)
    except ImportError as exc:
        raise ConfigurationError(f"PAYORCH[{what!r}]: cannot import {value!r}: {exc}") from exc


def tenant_resolver(spec: str | Tenant) -> Tenant:
    """The tenant of a request from ``spec``; ``None`` means "unauthenticated" (401).

    ``"header:X-Tenant-Id"`` (set by a trusted gateway; missing is a 400), ``"kwarg:tenant"``
    (a URL path parameter), ``"user"`` (the authenticated user's pk) or ``"user:attr.path"``
    (an attribute of it), a callable ``(request) -> str | None``, or a callable's dotted path.
    """
    if callable(spec):
        return spec
    kind, _, arg = spec.partition(":")
    if kind == "header" and arg:
        return functools.partial(_from_header, arg)
    if kind == "kwarg" and arg:
        return functools.partial(_from_kwarg, arg)
    if kind == "user":
        return functools.partial(_from_user, arg.split(".") if arg else ["pk"])
    if "." in spec and not arg:
        return tenant_resolver(cast(Tenant, _load(spec, "TENANT")))
    raise ConfigurationError(
        f"PAYORCH['TENANT'] = {spec!r}: use 'header:NAME', 'kwarg:NAME', 'user', "
        "'user:ATTR', a callable or its dotted path"
    )


def _from_header(name: str, request: HttpRequest) -> str:
    value = request.headers.get(name)
    if not value:
        raise InvalidTenant(f"the {name} header is missing")
    return str(value)


def _from_kwarg(name: str, request: HttpRequest) -> str:
    match = request.resolver_match
    value = match.kwargs.get(name) if match is not None else None
    if not value:
        raise ConfigurationError(f"the URL of {request.path!r} has no {name!r} parameter")
    return str(value)


def _from_user(attrs: list[str], request: HttpRequest) -> str | None:
    user = getattr(request, "user", None)  # set by AuthenticationMiddleware
    if user is None or not user.is_authenticated:
        return None
    value: Any = user
    for attr in attrs:
        value = getattr(value, attr, None)
    return None if value is None or value == "" else str(value)


@dataclass(frozen=True, kw_only=True)
class PayorchConfig:
    """``settings.PAYORCH``, checked. Unknown keys are refused (a typo would be silent)."""

    database_url: str
    providers: Callable[[], list[Provider]]
    registry: Callable[[list[Provider]], Registry]
    tenant: Tenant
    lease: timedelta | None  # None: the adapters' worst case (Executor's default)
    operation_url: str | None  # the URL name a 201/202's Location reverses
    outbox_hooks: OutboxHooks | None = None  # what settling an operation stages

    @classmethod
    def from_settings(cls) -> PayorchConfig:
        raw = getattr(django_settings, "PAYORCH", None)
        if not isinstance(raw, Mapping) or "PROVIDERS" not in raw:
            raise ConfigurationError("settings.PAYORCH must be a dict with at least PROVIDERS")
        unknown = set(raw) - _KEYS
        if unknown:
            raise ConfigurationError(f"settings.PAYORCH: unknown keys {sorted(unknown)}")
        lease = raw.get("LEASE_SECONDS")
        if lease is not None and not float(lease) > 0:
            raise ConfigurationError("settings.PAYORCH['LEASE_SECONDS'] must be positive")
        return cls(
            database_url=str(raw.get("DATABASE_URL") or Settings().database_url),
            providers=functools.partial(_providers, raw["PROVIDERS"]),
            registry=functools.partial(_registry, raw.get("REGISTRY")),
            tenant=tenant_resolver(raw.get("TENANT", "header:X-Tenant-Id")),
            lease=timedelta(seconds=float(lease)) if lease is not None else None,
            operation_url=raw.get("OPERATION_URL", "payorch-operation"),
            outbox_hooks=_hooks(raw.get("OUTBOX_HOOKS") or Settings().outbox_hooks),
        )


def _hooks(spec: Any) -> OutboxHooks | None:
    """``PAYORCH['OUTBOX_HOOKS']``: an ``OutboxHooks``, its dotted path, or its
    ``module:attribute`` path (as ``PAYORCH_OUTBOX_HOOKS`` gives it)."""
    if spec is None:
        return None
    if isinstance(spec, str) and ":" in spec:
        return load_hooks(spec)
    value = _load(spec, "OUTBOX_HOOKS")
    if not isinstance(value, OutboxHooks):
        raise ConfigurationError("PAYORCH['OUTBOX_HOOKS'] must give a payorch OutboxHooks")
    return value


def _providers(spec: Any) -> list[Provider]:
    value = _load(spec, "PROVIDERS")
    built = value() if callable(value) else value
    providers = list(cast(Iterable[Any], built))
    if not providers or not all(isinstance(p, Provider) for p in providers):
        raise ConfigurationError("PAYORCH['PROVIDERS'] must give one or more provider adapters")
    return providers


def _registry(spec: Any, providers: list[Provider]) -> Registry:
    if spec is None:  # one provider: every operation type runs on it
        return default_registry(providers[0].name if len(providers) == 1 else None)
    value = _load(spec, "REGISTRY")
    built = value if isinstance(value, Registry) else value()
    if not isinstance(built, Registry):
        raise ConfigurationError("PAYORCH['REGISTRY'] must give a payorch Registry")
    return built


# -- what is built once per process ---------------------------------------------------------


_REBUILDS = 3  # a runtime reset (settings changed) while its first check ran: build anew


class _Runtime:
    """The executors, handlers and stores, built on first use under one lock.

    The sync store's schema check runs outside that lock, one at a time: while it keeps
    failing (a database away, a schema not migrated), the store is kept and each other
    request answers the last refusal at once instead of queueing behind a check's I/O.
    """

    def __init__(self) -> None:
        self._forget()
        # A forked worker builds its own on first use: the parent's event loop and the
        # objects on it are not the child's (what they hold is dropped, not closed).
        reset_in_child(self, _Runtime._forget)

    def _forget(self) -> None:
        self.lock = threading.RLock()
        self.checking = threading.Lock()  # held by the one request running the check
        self.reset()

    def reset(self) -> None:
        self.config: PayorchConfig | None = None
        self.providers: list[Provider] | None = None
        self.registry: Registry | None = None
        self.store: Store | None = None
        self.checked: Store | None = None  # the sync store whose schema check passed
        self.refused: PayorchError | None = None  # the last failed check's error
        self.checks = 0  # checks ended: a request that waited for one takes its answer
        self.executor: Executor | None = None
        self.webhooks: WebhookHandler | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.astore: AsyncStore | None = None
        self.aexecutor: AsyncExecutor | None = None
        self.awebhooks: AsyncWebhookHandler | None = None
        self.achecked: AsyncStore | None = None  # the async store whose schema was checked

    def settings(self) -> tuple[PayorchConfig, list[Provider], Registry]:
        with self.lock:
            if self.config is None or self.providers is None or self.registry is None:
                config = PayorchConfig.from_settings()
                providers = config.providers()
                self.registry = config.registry(providers)
                self.config, self.providers = config, providers
            return self.config, self.providers, self.registry

    def sync(self) -> tuple[Executor, WebhookHandler]:
        for _ in range(_REBUILDS):
            with self.lock:
                if self.executor is not None and self.webhooks is not None:
                    return self.executor, self.webhooks
                config, _, _ = self.settings()
                if self.store is None:  # kept across failed checks: one pool, not one a request
                    self.store = Store.from_url(
                        config.database_url, outbox_hooks=config.outbox_hooks
                    )
                store = self.store
            # The start-up check, on first use: a schema to upgrade fails every request
            # loudly (503, logged), and is looked at again by a later one.
            self._check(store)
            with self.lock:
                if self.store is store:  # not reset (closed) while it was checked
                    return self._built(store)
        raise ConfigurationError("settings.PAYORCH kept changing while payorch started")

    def _built(self, store: Store) -> tuple[Executor, WebhookHandler]:
        if self.executor is None or self.webhooks is None:
            config, providers, registry = self.settings()
            self.executor = Executor(
                store=store,
                providers=providers,
                registry=registry,
                lease=config.lease,
                router=env_router(),
            )
            self.webhooks = WebhookHandler(store=store, providers=providers)
        return self.executor, self.webhooks

    def _check(self, store: Store) -> None:
        """``store.check_schema()`` by one request at a time. Another one arriving while it
        runs answers the last refusal at once; with none yet (the process's first check)
        it waits for that check's answer, not for a check of its own."""
        if self.checked is store:
            return
        seen, refused = self.checks, self.refused
        if not self.checking.acquire(blocking=refused is None):
            assert refused is not None  # a non-blocking acquire only with one to answer
            raise copy.copy(refused)  # a fresh error (no traceback shared across threads)
        try:
            if self.checked is store:
                return
            if self.checks != seen and self.refused is not None:
                raise copy.copy(self.refused)  # the check this request waited for failed
            try:
                store.check_schema()
            except PayorchError as exc:
                self.refused = copy.copy(exc)
                raise
            finally:
                self.checks += 1
            self.checked, self.refused = store, None
        finally:
            self.checking.release()

    def asynchronous(self) -> tuple[AsyncExecutor, AsyncWebhookHandler]:
        loop = asyncio.get_running_loop()
        with self.lock:  # nothing inside awaits: holding it on the loop is brief
            if self.loop is not None and self.loop is not loop:
                # An async engine's connections belong to one loop; under WSGI each async
                # view would run on a loop of its own.
                raise ConfigurationError(
                    "payorch's async views share one event loop: serve the project with an "
                    "ASGI server (uvicorn, daphne), or use sync views under WSGI"
                )
            if self.aexecutor is None or self.awebhooks is None:
                config, providers, registry = self.settings()
                adapters = [cast(AsyncProvider, p) for p in providers]
                store = self.astore = AsyncStore.from_url(
                    config.database_url, outbox_hooks=config.outbox_hooks
                )
                self.aexecutor = AsyncExecutor(
                    store=store,
                    providers=adapters,
                    registry=registry,
                    lease=config.lease,
                    router=env_router(),
                )
                self.awebhooks = AsyncWebhookHandler(store=store, providers=adapters)
                self.loop = loop
            return self.aexecutor, self.awebhooks


_runtime = _Runtime()


def config() -> PayorchConfig:
    """``settings.PAYORCH``, read and checked once."""
    return _runtime.settings()[0]


def store() -> Store:
    """The sync store the :func:`executor` writes to."""
    _runtime.sync()
    assert _runtime.store is not None  # built with the executor
    return _runtime.store


def async_store() -> AsyncStore:
    """The async store of the :func:`async_executor`."""
    return _runtime.asynchronous()[0].store


def executor() -> Executor:
    """The process's :class:`~payorch.Executor`, built from ``settings.PAYORCH`` on first use."""
    return _runtime.sync()[0]


def webhook_handler() -> WebhookHandler:
    return _runtime.sync()[1]


async def checked_async() -> None:
    """The async store's start-up check (``AsyncStore.check_schema``), on first use: run
    by the async views before they touch the store; ``SchemaNotReady`` until it passes."""
    astore = _runtime.asynchronous()[0].store
    if _runtime.achecked is not astore:
        await astore.check_schema()  # racing first requests may both check: harmless
        _runtime.achecked = astore


def async_executor() -> AsyncExecutor:
    """The :class:`~payorch.AsyncExecutor`, bound to the running (the ASGI server's) loop."""
    return _runtime.asynchronous()[0]


def async_webhook_handler() -> AsyncWebhookHandler:
    return _runtime.asynchronous()[1]


def close() -> None:
    """Drop what was built (the next request builds it anew); closes the sync store's pool.

    The async store's pool belongs to its loop and is dropped with it.
    """
    with _runtime.lock:
        if _runtime.store is not None:
            _runtime.store.close()
        _runtime.reset()


def _settings_changed(*, setting: str, **_: Any) -> None:
    if setting == "PAYORCH":  # override_settings in a project's tests
        close()


setting_changed.connect(_settings_changed)


def require_asgi(request: HttpRequest) -> None:
    """Refuse an async view served by WSGI, at once rather than on its second request:
    there each async view runs on an event loop of its own, and the async store's
    connections belong to one loop."""
    if not isinstance(request, ASGIRequest):
        raise ConfigurationError(
            "payorch's async views need an ASGI server (uvicorn, daphne); under WSGI use sync views"
        )


async def async_tenant(request: HttpRequest) -> str | None:
    """The tenant for an async view: never a blocking call on the loop."""
    require_asgi(request)
    resolve = _runtime.settings()[0].tenant
    if isinstance(resolve, functools.partial) and resolve.func in (_from_header, _from_kwarg):
        direct: str | None = resolve(request)  # no I/O
        return direct
    # request.user (and a custom resolver) may query the database: not on the loop.
    tenant: str | None = await sync_to_async(resolve)(request)
    return tenant


# -- the deploy step's check ---------------------------------------------------------------


def schema_check(
    app_configs: Any = None, databases: Iterable[str] | None = None, **_: Any
) -> list[checks.CheckMessage]:
    """``payorch.E001`` while payorch's schema is missing or behind (``payorch.E002``: the
    database or ``settings.PAYORCH`` unusable). Tagged ``database``: Django runs it only when
    asked for databases (``manage.py check --database default``, before ``migrate``), so
    nothing connects at import or in ``runserver``'s checks."""
    if not databases:
        return []
    try:
        probe = Store.from_url(PayorchConfig.from_settings().database_url)
        try:
            probe.check_schema()
        finally:
            probe.close()
    except SchemaNotReady as exc:
        return [checks.Error(exc.message, hint="run: payorch db upgrade", id="payorch.E001")]
    except PayorchError as exc:
        hint = "fix settings.PAYORCH or the database it names, then run the check again"
        return [checks.Error(exc.message, hint=hint, id="payorch.E002")]
    return []


_WEBHOOK_URL = "payorch-webhook"  # the name urls() gives its webhook route
_WEBHOOK_VIEWS = ("webhook_view", "async_webhook_view")


def _patterns(patterns: Iterable[Any]) -> Iterable[URLPattern]:
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from _patterns(pattern.url_patterns)
        elif isinstance(pattern, URLPattern):
            yield pattern


def _serves_webhooks() -> bool:
    """Whether the project's URLconf routes to payorch's webhook views (``urls()`` or
    ``webhook_view`` / ``async_webhook_view`` mounted by hand)."""
    if not getattr(django_settings, "ROOT_URLCONF", None):
        return False
    # Looked up, not imported: payorch.integrations.django imports this module, and a
    # URLconf that routes to its views has imported it already.
    views = sys.modules.get("payorch.integrations.django")
    ours = [getattr(views, name, None) for name in _WEBHOOK_VIEWS]
    return any(
        pattern.name == _WEBHOOK_URL or any(pattern.callback is view for view in ours if view)
        for pattern in _patterns(get_resolver().url_patterns)
    )


def webhook_secrets_check(app_configs: Any = None, **_: Any) -> list[checks.CheckMessage]:
    """``payorch.E003`` for each adapter of ``settings.PAYORCH`` built without its webhook
    secret while the URLconf serves payorch's webhook views: every delivery to it would fail
    verification, answered 500 and re-sent by the provider for days. Tagged ``urls``: it
    runs with ``runserver``, ``check`` and ``migrate``, and connects to nothing."""
    if not _serves_webhooks():
        return []
    try:
        providers = _runtime.settings()[1]
    except PayorchError as exc:
        hint = "fix settings.PAYORCH, then run the check again"
        return [checks.Error(exc.message, hint=hint, id="payorch.E002")]
    instead = "take payorch's webhook views out of the URLconf"
    refusals = (missing_webhook_secret(adapter, instead) for adapter in providers)
    return [checks.Error(r, id="payorch.E003") for r in refusals if r is not None]


class PayorchAppConfig(AppConfig):  # type: ignore[misc]  # django ships no type hints
    """``INSTALLED_APPS += ["payorch.integrations.django.PayorchAppConfig"]``: registers
    :func:`schema_check` and :func:`webhook_secrets_check`. payorch keeps its own tables: the
    app has no models."""

    name = "payorch.integrations.django"
    label = "payorch"
    verbose_name = "payorch"

    def ready(self) -> None:
        checks.register(schema_check, checks.Tags.database)
        checks.register(webhook_secrets_check, checks.Tags.urls)
