"""The async API's executor, :class:`AsyncExecutor`, and :func:`bridged_providers`, the sync
face of async adapters that every async driver hands its sync twin (the reconciler's and the
webhook handler's drivers are in :mod:`payorch.reconciling._async`).

Each is a thin driver around its sync twin. The sync flow (claim, submit, classify, record,
the inline retries, the late-answer fencing, the webhook inbox) runs unchanged under
:func:`~payorch.storage._bridge.run_bridged`; only its I/O differs: the database through an
:class:`~payorch.storage._async_store.AsyncStore`, the provider through an adapter's ``asubmit`` /
``aquery_status`` (httpx.AsyncClient), the pauses through ``asyncio.sleep``. So the decisions
exist once, and the guarantees and errors are the sync API's.

Cancelling a task in ``execute()`` is a crash of that request: what was committed stays, an
attempt possibly sent leaves the operation for the reconciler, as after ``kill -9``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

from pydantic import BaseModel

from ..errors import ConfigurationError
from ..operations import Registry
from ..outcome import Outcome
from ..provider import (
    VOID_CAPABILITIES,
    Answer,
    AsyncProvider,
    AsyncVoider,
    Capability,
    Resender,
    StatusQuery,
    SubmitRequest,
    VoidRequest,
    WebhookBatch,
    WebhookEvent,
    WireRequest,
    capabilities_of,
    parse_deliveries,
)
from ..routing import Router
from ..storage._async_store import AsyncStore
from ..storage._bridge import run_bridged, wait_for
from ._executor import Executor, RetryPolicy

__all__ = ["AsyncExecutor", "bridged_providers"]


class _Bridged:
    """The sync :class:`~payorch.provider.Provider` face of an async adapter, for the sync
    flows run under the bridge: each call awaits the adapter's coroutine on the loop."""

    def __init__(self, inner: AsyncProvider) -> None:
        if not isinstance(inner, AsyncProvider):
            raise ConfigurationError(
                f"provider {getattr(inner, 'name', inner)!r} has no async API "
                "(asubmit / aquery_status)"
            )
        self.inner = inner

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def idempotency_window(self) -> timedelta | None:
        return self.inner.idempotency_window

    @property
    def max_call_duration(self) -> timedelta:
        return self.inner.max_call_duration

    def submit(self, request: SubmitRequest) -> Answer:
        return wait_for(self.inner.asubmit(request))

    def query_status(self, query: StatusQuery) -> Answer:
        return wait_for(self.inner.aquery_status(query))

    def parse_webhook(self, headers: Mapping[str, str], body: bytes) -> WebhookEvent:
        return self.inner.parse_webhook(headers, body)

    def parse_webhooks(self, headers: Mapping[str, str], body: bytes) -> WebhookBatch:
        return parse_deliveries(self.inner, headers, body)

    @property
    def capabilities(self) -> frozenset[Capability]:
        caps = capabilities_of(self.inner)
        # A void needs the adapter's coroutine: without one, none is offered.
        return caps if isinstance(self.inner, AsyncVoider) else caps - VOID_CAPABILITIES

    def void(self, request: VoidRequest) -> Answer:
        if not isinstance(self.inner, AsyncVoider):
            raise ConfigurationError(f"provider {self.name!r} has no async void (avoid)")
        return wait_for(self.inner.avoid(request))


class _BridgedResender(_Bridged):
    """:class:`_Bridged` of an adapter that says what it sends (a ``Resender``)."""

    def wire_request(self, request: SubmitRequest) -> WireRequest | Answer:
        assert isinstance(self.inner, Resender)  # chosen so by bridged_providers
        return self.inner.wire_request(request)


def bridged_providers(providers: Iterable[AsyncProvider]) -> list[_Bridged]:
    return [_BridgedResender(p) if isinstance(p, Resender) else _Bridged(p) for p in providers]


class AsyncExecutor:
    """:class:`~payorch.execution._executor.Executor` for asyncio: the same arguments (``sleep`` is
    awaited), the same lease check at start-up, the same outcomes and errors."""

    def __init__(
        self,
        *,
        store: AsyncStore,
        providers: Iterable[AsyncProvider],
        registry: Registry | None = None,
        lease: timedelta | None = None,
        retry: RetryPolicy | None = None,
        owner: str | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
        key_scope: str | None = None,
        router: Router | None = None,
    ) -> None:
        self.store = store
        adapters = list(providers)
        self._sync = Executor(
            store=store.sync,
            providers=bridged_providers(adapters),
            registry=registry,
            lease=lease,
            retry=retry,
            owner=owner,
            key_scope=key_scope,
            router=router,
            sleep=lambda seconds: wait_for(sleep(seconds)),
            rand=rand,
        )
        self.providers: dict[str, AsyncProvider] = {p.name: p for p in adapters}
        self._sleep = sleep

    @property
    def registry(self) -> Registry:
        return self._sync.registry

    @property
    def lease(self) -> timedelta:
        return self._sync.lease

    @property
    def retry(self) -> RetryPolicy:
        return self._sync.retry

    @property
    def owner(self) -> str:
        return self._sync.owner

    def provider(self, name: str) -> AsyncProvider:
        """The adapter for a provider name a caller gave; ``UnknownProvider`` (4xx) if none."""
        return self.providers[self._sync.provider(name).name]

    async def execute(
        self,
        *,
        tenant_id: str,
        operation: str,
        idempotency_key: str,
        request: Mapping[str, Any] | BaseModel,
        provider: str | None = None,
        wait: timedelta | None = None,
    ) -> Outcome:
        """:meth:`Executor.execute <payorch.execution._executor.Executor.execute>`, awaited.

        A ``wait`` on a duplicate in progress naps on the event loop; other tasks run.
        """
        return await run_bridged(
            self._sync.execute,
            tenant_id=tenant_id,
            operation=operation,
            idempotency_key=idempotency_key,
            request=request,
            provider=provider,
            wait=wait,
        )
