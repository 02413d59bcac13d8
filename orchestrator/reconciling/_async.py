"""The async reconciler and webhook handler: thin drivers around their sync twins, run under
the greenlet bridge exactly as :class:`~payorch.AsyncExecutor` is (see
:mod:`payorch.execution._async`).
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Callable, Collection, Iterable, Mapping

from ..errors import ConfigurationError
from ..execution._async import bridged_providers
from ..execution._executor import RetryPolicy
from ..outcome import WebhookDelivery, WebhookResult
from ..provider import AsyncProvider
from ..storage._async_store import AsyncStore
from ..storage._bridge import run_bridged
from ._reconciler import Reconciler, ReconcileReport, ReconcilerPolicy
from ._webhooks import WebhookHandler

__all__ = ["AsyncReconciler", "AsyncWebhookHandler"]


class AsyncWebhookHandler:
    """:class:`~payorch.WebhookHandler` for asyncio (verification does no I/O)."""

    def __init__(
        self, *, store: AsyncStore, providers: Iterable[AsyncProvider], actor: str = "webhook"
    ) -> None:
        self.store = store
        self._sync = WebhookHandler(
            store=store.sync, providers=bridged_providers(providers), actor=actor
        )

    async def handle(
        self, tenant_id: str, provider: str, headers: Mapping[str, str], body: bytes
    ) -> WebhookResult:
        """:meth:`WebhookHandler.handle <payorch.WebhookHandler.handle>`, awaited."""
        return await run_bridged(self._sync.handle, tenant_id, provider, headers, body)

    async def handle_delivery(
        self, tenant_id: str, provider: str, headers: Mapping[str, str], body: bytes
    ) -> WebhookDelivery:
        """:meth:`WebhookHandler.handle_delivery <payorch.WebhookHandler.handle_delivery>`,
        awaited."""
        return await run_bridged(self._sync.handle_delivery, tenant_id, provider, headers, body)


class AsyncReconciler:
    """:class:`~payorch.Reconciler` for asyncio: one pass, or passes until idle."""

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
            providers=bridged_providers(providers),
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
