"""The durable store for the async API: :class:`AsyncStore`.

No SQL here. An :class:`AsyncStore` is the sync :class:`~payorch.storage._store.Store` built on the
sync face of an async engine (psycopg's async driver, or aiosqlite), each method run by
:func:`~payorch.storage._bridge.run_bridged`: every round trip awaits on the event loop, and the
claim, the fencing and the error mapping are the very same code as the sync store's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..core import State
from ..errors import CorruptRecord
from ..records import ClaimResult, EventRecord, NewOperation, OperationRecord
from ._bridge import run_bridged
from ._engine import create_async_engine
from ._outbox import OutboxHooks
from ._replication import Status
from ._store import QUARANTINE_HOLD, Store

if TYPE_CHECKING:
    from sqlalchemy.engine import URL
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["AsyncStore"]


class AsyncStore:
    """Operations and their events on PostgreSQL or SQLite, awaited.

    Same methods, arguments, results and errors as :class:`~payorch.storage._store.Store`, as
    coroutines. ``sync`` is the store the async executor and handler drive under the bridge.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        require_sync_standby: bool | None = None,
        outbox_hooks: OutboxHooks | None = None,
    ) -> None:
        self.engine = engine
        self.sync = Store(
            engine.sync_engine,
            require_sync_standby=require_sync_standby,
            outbox_hooks=outbox_hooks,
        )
        self.dialect = self.sync.dialect

    @classmethod
    def from_url(
        cls, url: str | URL, *, outbox_hooks: OutboxHooks | None = None, **engine_kwargs: Any
    ) -> AsyncStore:
        """An async engine configured as :func:`payorch.db.create_engine` configures one."""
        return cls(create_async_engine(url, **engine_kwargs), outbox_hooks=outbox_hooks)

    async def check_replication(self) -> Status:
        """The start-up check of :meth:`payorch.storage._replication.Guard.check`, awaited: the
        replication mode, logged; refused (``ConfigurationError``) when the store requires
        a synchronous standby and none streams. (A sync store checks when it is built.)"""
        return await run_bridged(self.sync.replication.check)

    async def check_schema(self) -> str:
        """:meth:`Store.check_schema`, awaited: one read, on start-up; ``SchemaNotReady``
        (with what was found and the command to run) unless the database is at this
        install's head revision."""
        return await run_bridged(self.sync.check_schema)

    @property
    def is_postgres(self) -> bool:
        return self.sync.is_postgres

    async def close(self) -> None:
        listener = self.sync._listener
        if listener is not None:
            listener.close()
        await self.engine.dispose()

    async def __aenter__(self) -> AsyncStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- the Store's methods, awaited ---------------------------------------------------

    async def claim(
        self,
        new: NewOperation,
        *,
        owner: str,
        lease: timedelta,
        possibly_sent: bool = False,
        wait: timedelta | None = None,
    ) -> ClaimResult:
        """:meth:`Store.claim`; a ``wait`` naps on the event loop, never blocking it."""
        return await run_bridged(
            self.sync.claim, new, owner=owner, lease=lease, possibly_sent=possibly_sent, wait=wait
        )

    async def get(self, tenant_id: str, operation_id: str) -> OperationRecord:
        return await run_bridged(self.sync.get, tenant_id, operation_id)

    async def find(self, operation_id: str) -> OperationRecord:
        return await run_bridged(self.sync.find, operation_id)

    async def get_by_namespace(self, tenant_id: str, operation: str, key: str) -> OperationRecord:
        return await run_bridged(self.sync.get_by_namespace, tenant_id, operation, key)

    async def find_by_reference(
        self, tenant_id: str, provider: str, reference: str
    ) -> OperationRecord | None:
        return await run_bridged(self.sync.find_by_reference, tenant_id, provider, reference)

    async def events(self, tenant_id: str, operation_id: str) -> list[EventRecord]:
        return await run_bridged(self.sync.events, tenant_id, operation_id)

    async def transition(
        self, record: OperationRecord, to_state: State, **kwargs: Any
    ) -> OperationRecord:
        """:meth:`Store.transition` (same keyword arguments; ``also`` gets a sync
        ``Connection`` and runs inside the transaction, as there)."""
        return await run_bridged(self.sync.transition, record, to_state, **kwargs)

    async def append_event(
        self,
        record: OperationRecord,
        *,
        kind: str,
        actor: str,
        detail: Mapping[str, Any] | None = None,
    ) -> None:
        await run_bridged(self.sync.append_event, record, kind=kind, actor=actor, detail=detail)

    async def flag_attention(
        self, record: OperationRecord, *, kind: str, actor: str, detail: Mapping[str, Any]
    ) -> OperationRecord:
        return await run_bridged(
            self.sync.flag_attention, record, kind=kind, actor=actor, detail=detail
        )

    async def db_time(self) -> datetime:
        return await run_bridged(self.sync.db_time)

    async def claim_due(
        self,
        *,
        owner: str,
        lease: timedelta,
        limit: int,
        tenant_ids: Collection[str] | None = None,
        quarantine: timedelta = QUARANTINE_HOLD,
        on_quarantine: Callable[[CorruptRecord], None] | None = None,
    ) -> list[tuple[OperationRecord, datetime]]:
        return await run_bridged(
            self.sync.claim_due,
            owner=owner,
            lease=lease,
            limit=limit,
            tenant_ids=tenant_ids,
            quarantine=quarantine,
            on_quarantine=on_quarantine,
        )

    async def release(self, record: OperationRecord) -> None:
        await run_bridged(self.sync.release, record)

    async def wait_until_settled(self, record: OperationRecord, wait: timedelta) -> OperationRecord:
        return await run_bridged(self.sync.wait_until_settled, record, wait)
