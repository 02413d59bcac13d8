"""The httpx clients of a provider adapter: the caller's, or built from its settings.

A client or transport the caller passes stays the caller's: used, never closed or renewed.
A client built here is closed by :meth:`HttpClients.close` / :meth:`HttpClients.aclose`, and
dropped in a forked child (its keep-alive connections are the parent's: two processes on one
connection read each other's responses), to be built again on the child's first call. The
async client is built on first async use, so a sync-only user never opens one.
"""

from __future__ import annotations

import httpx

from .forks import reset_in_child

__all__ = ["HttpClients"]


class HttpClients:
    """One adapter's sync and async httpx clients."""

    def __init__(
        self,
        *,
        timeout: httpx.Timeout,
        client: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
        async_client: httpx.AsyncClient | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._timeout = timeout
        self._owns_sync = client is None
        self._sync: httpx.Client | None = client or httpx.Client(
            timeout=timeout, transport=transport
        )
        self._async = async_client
        self._owns_async = async_client is None
        self._async_transport = async_transport
        # Renewed in a forked child: only what was built from settings alone.
        self._renews_sync = client is None and transport is None
        self._renews_async = async_client is None and async_transport is None
        if self._renews_sync or self._renews_async:
            reset_in_child(self, HttpClients._forget)

    @property
    def sync(self) -> httpx.Client:
        client = self._sync
        if client is None:  # only in a forked child, before its first call
            client = self._sync = httpx.Client(timeout=self._timeout)
        return client

    def asynchronous(self) -> httpx.AsyncClient:
        client = self._async
        if client is None:
            client = self._async = httpx.AsyncClient(
                timeout=self._timeout, transport=self._async_transport
            )
        return client

    def close(self) -> None:
        """Close the sync client if it was built here."""
        if self._owns_sync and self._sync is not None:
            self._sync.close()

    async def aclose(self) -> None:
        """Close both clients built here (the async one on the running loop)."""
        self.close()
        if self._owns_async and self._async is not None:
            await self._async.aclose()
            self._async = None

    def _forget(self) -> None:
        # Dropped, not closed (the parent still uses them); built again on first use, not
        # here: a fork hook must stay quick.
        if self._renews_sync:
            self._sync = None
        if self._renews_async:
            self._async = None
