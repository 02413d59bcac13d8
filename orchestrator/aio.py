"""The async API: :class:`AsyncExecutor`, :class:`AsyncWebhookHandler`, :class:`AsyncReconciler`.

Each is a thin driver around its sync twin. The sync flow (claim, submit, classify, record,
the inline retries, the late-answer fencing, the webhook inbox) runs unchanged under
:func:`~payorch.bridge.run_bridged`; only its I/O differs: the database through an
:class:`~payorch.async_store.AsyncStore`, the provider through an adapter's ``asubmit`` /
``aquery_status`` (httpx.AsyncClient), the pauses through ``asyncio.sleep``. So the decisions
exist once, and the guarantees and errors are the sync API's.

Cancelling a task in ``execute()`` is a crash of that request: what was committed stays, an
attempt possibly sent leaves the operation for the reconciler, as after ``kill -9``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from datetime import timedelta
from typing import Any

from pydantic import BaseModel

from .async_store import AsyncStore
from .bridge import run_bridged, wait_for
from .errors import ConfigurationError
from .executor import Executor, RetryPolicy
from .operations import Registry
from .outcome import Outcome
from .provider import Answer, AsyncProvider, StatusQuery, SubmitRequest, WebhookEvent
from .reconciler import Reconciler, ReconcileReport, ReconcilerPolicy
from .webhooks import WebhookHandler, WebhookResult

__all__ = ["AsyncExecutor", "AsyncReconciler", "AsyncWebhookHandler"]


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


def _bridged(providers: Iterable[AsyncProvider]) -> list[_Bridged]:
    return [_Bridged(p) for p in providers]


class AsyncExecutor:
    """:class:`~payorch.executor.Executor` for asyncio: the same arguments (``sleep`` is
    awaited), the same lease check at start-up, the same outcomes and errors."""

    def __init__(
        self,
        *,
        store: AsyncStore,
        providers: Iterable[AsyncProvider],
        registry: Registry | None = None,
        lease: timedelta = timedelta(seconds=60),
        retry: RetryPolicy | None = None,
        owner: str | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
        key_scope: str | None = None,
    ) -> None:
        self.store = store
        adapters = list(providers)
        self._sync = Executor(
            store=store.sync,
            providers=_bridged(adapters),
            registry=registry,
            lease=lease,
            retry=retry,
            owner=owner,
            key_scope=key_scope,
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
        """:meth:`Executor.execute <payorch.executor.Executor.execute>`, awaited.

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


class AsyncWebhookHandler:
    """:class:`~payorch.webhooks.WebhookHandler` for asyncio (verification does no I/O)."""

    def __init__(
        self, *, store: AsyncStore, providers: Iterable[AsyncProvider], actor: str = "webhook"
    ) -> None:
        self.store = store
        self._sync = WebhookHandler(store=store.sync, providers=_bridged(providers), actor=actor)

    async def handle(
        self, tenant_id: str, provider: str, headers: Mapping[str, str], body: bytes
    ) -> WebhookResult:
        """:meth:`WebhookHandler.handle <payorch.webhooks.WebhookHandler.handle>`, awaited."""
        return await run_bridged(self._sync.handle, tenant_id, provider, headers, body)


class AsyncReconciler:
    """:class:`~payorch.reconciler.Reconciler` for asyncio: one pass, or passes until idle."""

    def __init__(
        self,
        *,
        store: AsyncStore,
        providers: Iterable[AsyncProvider],
        policy: ReconcilerPolicy | None = None,
        owner: str | None = None,
        submit_retry: RetryPolicy | None = None,
        rand: Callable[[], float] = random.random,
        tenant_ids: Collection[str] | None = None,
    ) -> None:
        self.store = store
        # Checks run one at a time: under the greenlet bridge every database call must stay
        # in the awaiting task's greenlet, so the sync twin's worker threads cannot be used.
        # Drain large backlogs with the sync daemon (`payorch reconcile run`) or several tasks.
        policy = policy or ReconcilerPolicy()
        if policy.concurrency not in (None, 1):
            raise ConfigurationError(
                f"AsyncReconciler checks one operation at a time (concurrency "
                f"{policy.concurrency} given); use the sync Reconciler for concurrent checks"
            )
        self._sync = Reconciler(
            store=store.sync,
            providers=_bridged(providers),
            policy=dataclasses.replace(policy, concurrency=1),
            owner=owner,
            submit_retry=submit_retry,
            rand=rand,
            tenant_ids=tenant_ids,
        )

    async def reconcile_once(self, stop: threading.Event | None = None) -> ReconcileReport:
        return await run_bridged(self._sync.reconcile_once, stop)

    async def run_until_idle(self, max_passes: int = 100) -> ReconcileReport:
        return await run_bridged(self._sync.run_until_idle, max_passes)
