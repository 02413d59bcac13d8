"""Writes that move or mark an operation: the fenced transition, evidence that moves
nothing, and the attention flag. A mixin of :class:`~payorch.storage._store.Store`.

A transition is ``UPDATE ... WHERE version = :v RETURNING`` plus its event row in one
transaction; a lost compare-and-set raises :class:`StaleVersion` and changes nothing. On
PostgreSQL a plain transition is one data-modifying statement in autocommit
(``pg_transition_sql``). Waiters hear an operation leave ``in_progress`` by a NOTIFY sent as
the write commits: from the statement itself on one PostgreSQL; on Citus, whose workers run
the statement, by the coordinator in the write's transaction (a worker's NOTIFY reaches
nobody listening on the coordinator).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core import State, check_transition
from ..errors import StaleVersion
from ..records import OperationRecord
from . import _pg_writes as pg_writes
from ._engine import run_in_transaction
from ._folded import answer_event
from ._outbox import OutboxHooks, stage_settled, staging
from ._statements import PG_NOTIFY, Shape, add_event, build_update, new_id
from ._tables import db_now, operations
from ._waiting import NOTIFY_CHANNEL

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

__all__ = ["Transitions"]

_UNSET: Any = object()


class Transitions:
    """``transition``, ``append_event``, ``flag_attention``."""

    if TYPE_CHECKING:
        engine: Engine
        outbox_hooks: OutboxHooks | None
        _updates: dict[Shape, Any]
        _pg_updates: dict[Any, str]

        @property
        def is_postgres(self) -> bool: ...

        @property
        def distributed(self) -> bool: ...

    def transition(
        self,
        record: OperationRecord,
        to_state: State,
        *,
        kind: str,
        actor: str,
        detail: Mapping[str, Any] | None = None,
        lease: timedelta | None = None,
        lease_owner: str | None = None,
        next_check_in: timedelta | None = None,
        provider_reference: str | None = None,
        response: Mapping[str, Any] | None = _UNSET,
        request: Mapping[str, Any] | None = _UNSET,
        error_code: str | None = _UNSET,
        resolution: str | None = _UNSET,
        possibly_sent: bool = _UNSET,
        attempts_delta: int = 0,
        checks_delta: int = 0,
        needs_attention: bool = _UNSET,
        provider: str = _UNSET,
        downstream_key: str = _UNSET,
        route: Mapping[str, Any] | None = _UNSET,
        moved_on: bool = False,
        also: Callable[[Connection, OperationRecord], None] | None = None,
        guard: sa.ColumnElement[bool] | None = None,
        first_answer: bool = False,
    ) -> OperationRecord:
        """Move ``record`` to ``to_state`` if nobody wrote it since it was read.

        The UPDATE is fenced by ``version``; its event row shares the transaction. Passing
        ``lease`` (re)takes the lease for ``lease_owner``; otherwise the lease is released.
        ``also`` runs in the same transaction (e.g. the webhook inbox row). ``guard`` is an
        extra condition of the UPDATE, judged by the database at write time; when it fails
        the write is refused like a lost compare-and-set. ``provider``, ``downstream_key``
        and ``route``: a routed operation moving to its next provider (payorch.routing),
        ``moved_on`` then clearing the reference its route now keeps.
        """
        check_transition(record.state, to_state)
        plain: dict[str, Any] = {}
        if provider_reference is not None:  # once known, a reference is never forgotten
            plain["provider_reference"] = provider_reference
        elif moved_on:
            # ... by the attempt that made it: a routed operation moving to its next
            # provider keeps the last one's reference in its route, and starts afresh.
            plain["provider_reference"] = None
        for name, value in (
            ("response", response),
            ("request", request),
            ("error_code", error_code),
            ("resolution", resolution),
            ("possibly_sent", possibly_sent),
            ("needs_attention", needs_attention),
            ("provider", provider),
            ("downstream_key", downstream_key),
            ("route", route),
        ):
            if value is not _UNSET:
                plain[name] = dict(value) if isinstance(value, Mapping) else value
        if lease is not None:
            plain["lease_owner"] = lease_owner
        event_id = new_id()
        event = {"id": event_id, "kind": kind, "actor": actor, "detail": detail}
        kept = (  # an uneventful answer: terminal, right after the claim, not flagged
            first_answer
            and needs_attention is not True
            and to_state.terminal
            and record.state is State.IN_PROGRESS
            and record.version == 1
        )
        if kept:
            reference = provider_reference or record.provider_reference
            plain["answer_event"] = answer_event(
                record, kind, actor, detail, provider_reference=reference
            )
        # Waiters only ever wait on in_progress: notify when an operation leaves it, or is
        # released (nothing sent, no lease: a waiter may run it again); and only if someone
        # waits (the row's ``waited``, set by the waiter before it naps).
        notify = (
            self.is_postgres
            and record.state is State.IN_PROGRESS
            and (to_state is not State.IN_PROGRESS or (lease is None and possibly_sent is False))
        )
        shape = Shape(
            plain=tuple(sorted(plain)),
            lease=lease is not None,
            next_check=next_check_in is not None,
            terminal=to_state.terminal,
            attempts=bool(attempts_delta),
            checks=bool(checks_delta),
            event=not kept,
            notify=notify,
        )
        # The parameters of both forms of the write (pg_transition_sql and build_update).
        params: dict[str, Any] = {f"u_{k}": v for k, v in plain.items()}
        params.update(
            u_state=to_state.value,
            w_tenant_id=record.tenant_id,
            w_id=record.id,
            w_version=record.version,
            u_lease_s=lease.total_seconds() if lease is not None else None,
            u_next_s=next_check_in.total_seconds() if next_check_in is not None else None,
            u_attempts=attempts_delta,
            u_checks=checks_delta,
            u_retention_s=record.retention_seconds,
            u_channel=NOTIFY_CHANNEL,
        )
        hooks = staging(self.outbox_hooks, record.operation, to_state)
        if self.is_postgres and guard is None and also is None and hooks is None:
            return pg_writes.transition(
                self.engine,
                self._pg_updates,
                record,
                shape=shape,
                params=params,
                event=event if shape.event else None,
                distributed=self.distributed,
            )
        stmt = self._updates.get(shape) if guard is None else None
        if stmt is None:
            stmt = build_update(shape, guard)
            if guard is None:
                self._updates[shape] = stmt

        def txn(conn: Connection) -> OperationRecord:
            row = conn.execute(stmt, params).mappings().first()
            if row is None:
                raise StaleVersion(
                    f"operation {record.id} changed since version {record.version}",
                    operation_id=record.id,
                )
            updated = OperationRecord.from_row(row)
            if shape.event:
                add_event(
                    conn,
                    updated,
                    kind=kind,
                    actor=actor,
                    from_state=record.state,
                    to_state=to_state,
                    detail=detail,
                    event_id=event_id,
                )
            if also is not None:
                also(conn, updated)
            if hooks is not None:  # the messages commit with the outcome, or neither does
                stage_settled(conn, hooks, updated)
            if notify and row["waited"]:  # sent as this commits
                conn.exec_driver_sql(PG_NOTIFY, params)
            return updated

        return run_in_transaction(self.engine, txn)

    def append_event(
        self,
        record: OperationRecord,
        *,
        kind: str,
        actor: str,
        detail: Mapping[str, Any] | None = None,
        also: Callable[[Connection, OperationRecord], None] | None = None,
    ) -> None:
        """Record evidence that does not move the operation (e.g. a stale worker's answer)."""

        def txn(conn: Connection) -> None:
            if also is not None:
                also(conn, record)
            add_event(
                conn, record, kind=kind, actor=actor, from_state=None, to_state=None, detail=detail
            )

        run_in_transaction(self.engine, txn)

    def flag_attention(
        self,
        record: OperationRecord,
        *,
        kind: str,
        actor: str,
        detail: Mapping[str, Any],
        also: Callable[[Connection, OperationRecord], None] | None = None,
    ) -> OperationRecord:
        """Set ``needs_attention`` (any state, terminal included) with an event; fenced."""

        def txn(conn: Connection) -> OperationRecord:
            row = (
                conn.execute(
                    sa.update(operations)
                    .where(
                        operations.c.tenant_id == record.tenant_id,
                        operations.c.id == record.id,
                        operations.c.version == record.version,
                    )
                    .values(
                        needs_attention=True,
                        version=operations.c.version + 1,
                        updated_at=db_now(),
                    )
                    .returning(*operations.c)
                )
                .mappings()
                .first()
            )
            if row is None:
                raise StaleVersion(f"operation {record.id} changed", operation_id=record.id)
            updated = OperationRecord.from_row(row)
            if also is not None:
                also(conn, updated)
            add_event(
                conn, updated, kind=kind, actor=actor, from_state=None, to_state=None, detail=detail
            )
            return updated

        return run_in_transaction(self.engine, txn)
