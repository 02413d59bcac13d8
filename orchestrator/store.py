"""The durable store: claim, replay, fenced transitions and the append-only event log.

Every write is one statement guarded by a constraint or a version:

* the claim is ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` on the namespace key;
* a transition is ``UPDATE ... WHERE version = :v RETURNING`` plus its event row, in one
  transaction; a lost compare-and-set raises :class:`StaleVersion` and changes nothing.

On PostgreSQL the claim and the plain transitions are each one data-modifying statement run
in autocommit (``statements.PG_CLAIM``, ``pg_transition_sql``): one round trip apiece.

Times are the database's (``db_now``), so hosts with skewed clocks agree on leases.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Mapping
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
import uuid6
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, Engine

from . import pg_writes
from .core import State, check_transition, downstream_key
from .db import create_engine, read_in_transaction, run_in_transaction, run_statement
from .errors import (
    CommitUncertain,
    CorruptRecord,
    IdempotencyKeyExpired,
    IdempotencyKeyReused,
    OperationInProgress,
    OperationNotFound,
    StaleVersion,
)
from .records import ClaimResult, EventRecord, NewOperation, OperationRecord
from .statements import (
    EVENT_INSERT,
    PG_CLAIMED,
    PG_EXISTING,
    REPLAY_BY_ID,
    REPLAY_BY_NAMESPACE,
    build_claim,
    build_update,
    lease_row,
)
from .tables import db_now, db_now_plus, events, is_active, operations
from .waiting import NOTIFY_CHANNEL, Listener, wait_until_settled

__all__ = ["NOTIFY_CHANNEL", "QUARANTINE_EVENT", "QUARANTINE_HOLD", "Store", "new_id"]

_UNSET: Any = object()

# A row that cannot be read is set aside, not retried every pass: an operator must repair
# it. After the hold it is picked (and, if still corrupt, quarantined) again.
QUARANTINE_EVENT = "quarantined"
QUARANTINE_HOLD = timedelta(hours=1)

# "In progress" tells a client when to look again, not how long the lease lasts: the lease
# bounds the whole call with every inline retry (minutes with Stripe's time-outs). Look again
# after about as long as the attempt has run so far (a quick call is over soon, a slow one
# is likely to stay slow), at least 1 s, at most this, and not past a live lease's expiry.
IN_PROGRESS_RETRY_CAP = 5.0
_PG_CLAIM_ATTEMPTS = 3  # then the general transaction decides


def look_again_after(record: OperationRecord, lease_remaining: float) -> float:
    """Seconds an ``OperationInProgress`` asks the client to wait (``Retry-After``)."""
    if record.lease_expires_at is None:
        return 1.0
    # now = lease_expires_at - lease_remaining (the database's clock), so the time since the
    # operation's last write is (lease_expires_at - updated_at) - lease_remaining.
    ran = (record.lease_expires_at - record.updated_at).total_seconds() - lease_remaining
    wait = min(ran, IN_PROGRESS_RETRY_CAP)
    if lease_remaining > 0:
        wait = min(wait, lease_remaining)
    return max(1.0, round(wait, 1))


def new_id() -> str:
    """A time-ordered UUID (v7): ids sort by creation, indexes stay append-mostly."""
    return str(uuid6.uuid7())


class Store:
    """Operations and their events on PostgreSQL or SQLite."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        # Hot statements are built once: SQLAlchemy then skips coercion and cache-key work.
        self._claim_stmt = build_claim(
            postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        )
        self._updates: dict[tuple[Any, ...], Any] = {}
        self._pg_updates: dict[tuple[Any, ...], str] = {}
        self._listener: Listener | None = None
        self._listener_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str | URL, **engine_kwargs: Any) -> Store:
        return cls(create_engine(url, **engine_kwargs))

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        self.engine.dispose()

    def listener(self) -> Listener | None:
        """The shared LISTEN connection for waiters (PostgreSQL), started on first use."""
        if not self.is_postgres:
            return None
        with self._listener_lock:
            if self._listener is None:
                url = self.engine.url.set(drivername="postgresql")
                self._listener = Listener(url.render_as_string(hide_password=False))
            return self._listener

    @property
    def is_postgres(self) -> bool:
        return self.dialect == "postgresql"

    # -- claim ------------------------------------------------------------------------

    def claim(
        self,
        new: NewOperation,
        *,
        owner: str,
        lease: timedelta,
        possibly_sent: bool = False,
        wait: timedelta | None = None,
    ) -> ClaimResult:
        """Claim the namespace or return what already holds it.

        New namespace: the operation row (``in_progress``, lease held by ``owner``, downstream
        key) and its ``claimed`` event are committed before this returns. Existing namespace:
        replay a terminal outcome, return an ``outcome_unknown`` one as it stands, refuse a
        changed fingerprint, or report/wait for one in progress (``wait`` bounds the wait).
        ``possibly_sent=True`` records, in the same commit, that the caller is about to send.
        """
        op_id = new_id()
        lease_s = lease.total_seconds()
        if self.is_postgres:
            fast = self._claim_pg(new, op_id, owner, lease_s, possibly_sent)
            if fast is not None:
                record, created, lease_remaining = fast
                if created:
                    return ClaimResult(operation=record, created=True)
                return self._existing(record, new, lease_remaining, wait)

        params = {
            "c_tenant_id": new.tenant_id,
            "c_id": op_id,
            "c_operation": new.operation,
            "c_idempotency_key": new.idempotency_key,
            "c_fingerprint": new.fingerprint,
            "c_state": State.IN_PROGRESS.value,
            "c_provider": new.provider,
            "c_downstream_key": downstream_key(op_id),
            "c_amount": new.amount,
            "c_currency": new.currency,
            "c_request": dict(new.request) if new.request is not None else None,
            "c_retention_seconds": int(new.retention.total_seconds()),
            "c_possibly_sent": possibly_sent,
            "c_attempts": 1 if possibly_sent else 0,
            "c_lease_owner": owner,
            "c_lease_s": lease_s,
        }

        replay_params = {
            "r_tenant_id": new.tenant_id,
            "r_operation": new.operation,
            "r_idempotency_key": new.idempotency_key,
            "r_fingerprint": new.fingerprint,
        }
        attempted: list[tuple[OperationRecord, bool, float]] = []  # what the COMMIT carried

        def txn(conn: Connection) -> tuple[OperationRecord, bool, float]:
            attempted.clear()  # a retried transaction starts over
            row = conn.execute(self._claim_stmt, params).mappings().first()
            if row is not None:
                record = OperationRecord.from_row(row)
                self._add_event(
                    conn,
                    record,
                    kind="claimed",
                    actor=owner,
                    from_state=None,
                    to_state=State.IN_PROGRESS,
                    detail={"idempotency_key": new.idempotency_key, "fingerprint": new.fingerprint},
                )
                attempted.append((record, True, 0.0))
                return record, True, 0.0
            # A replay (the common duplicate) is read and counted by one statement; only
            # what is not a replay is read as it stands.
            found = conn.execute(REPLAY_BY_NAMESPACE, replay_params).mappings().first()
            counted = found is not None
            if found is None:
                found = (
                    conn.execute(
                        sa.select(operations, db_now().label("_now")).where(
                            operations.c.tenant_id == new.tenant_id,
                            operations.c.operation == new.operation,
                            operations.c.idempotency_key == new.idempotency_key,
                        )
                    )
                    .mappings()
                    .one()
                )
            existing = OperationRecord.from_row(found)
            remaining = 0.0
            if existing.lease_expires_at is not None:
                remaining = (existing.lease_expires_at - found["_now"]).total_seconds()
            # Conflicts go to the operation's log (stats, audit); replays are only counted
            # on the row (replays, last_replayed_at), never logged one by one.
            noted = _duplicate_kind(existing, new)
            if noted == "replayed" and not counted:
                # It became terminal between the two reads (PostgreSQL reads each statement
                # afresh): count this replay too.
                existing = self._count_replay(conn, existing) or existing
            elif noted is not None and noted != "replayed":
                self._add_event(
                    conn,
                    existing,
                    kind=noted,
                    actor=owner,
                    from_state=None,
                    to_state=None,
                    detail={"offered_fingerprint": new.fingerprint},
                )
            attempted.append((existing, False, remaining))
            return existing, False, remaining

        try:
            record, created, lease_remaining = run_in_transaction(self.engine, txn)
        except CommitUncertain as exc:
            if not attempted or attempted[0][1]:
                raise _claim_uncertain(new, op_id) from exc
            # Someone else's operation holds the namespace; only our audit event is in doubt.
            record, created, lease_remaining = attempted[0]
        if created:
            return ClaimResult(operation=record, created=True)
        return self._existing(record, new, lease_remaining, wait)

    def _claim_pg(
        self, new: NewOperation, op_id: str, owner: str, lease_s: float, possibly_sent: bool
    ) -> tuple[OperationRecord, bool, float] | None:
        """The claim on PostgreSQL: claim + event, or replay counted, or the row, in one
        statement committed on its own (one round trip). None when the statement could not
        decide (a racing duplicate it cannot see, or a replay it did not count): the caller
        then runs the general transaction."""
        event_id = new_id()
        for _ in range(_PG_CLAIM_ATTEMPTS):
            try:
                found = pg_writes.claim(
                    self.engine,
                    new,
                    op_id=op_id,
                    event_id=event_id,
                    owner=owner,
                    lease_s=lease_s,
                    possibly_sent=possibly_sent,
                )
            except CommitUncertain as exc:
                raise _claim_uncertain(new, op_id) from exc
            if found is not None:
                break
            # A racing duplicate committed the namespace after our snapshot was taken: we
            # inserted nothing and saw nothing. A new statement (a new snapshot) sees it.
        else:
            return None
        kind, record, now = found
        if kind == PG_CLAIMED:
            return record, True, 0.0
        noted = _duplicate_kind(record, new)
        if kind == PG_EXISTING and noted == "replayed":
            return None  # terminal, yet not counted (reaped meanwhile?): judge it afresh
        remaining = 0.0
        if record.lease_expires_at is not None:
            remaining = (record.lease_expires_at - now).total_seconds()
        if noted is not None and noted != "replayed":
            # Conflicts go to the operation's log (stats, audit): a statement of its own.
            detail = {"offered_fingerprint": new.fingerprint}
            with contextlib.suppress(CommitUncertain):  # only our audit event is in doubt
                run_statement(
                    self.engine,
                    lambda conn: self._add_event(
                        conn,
                        record,
                        kind=noted,
                        actor=owner,
                        from_state=None,
                        to_state=None,
                        detail=detail,
                    ),
                )
        return record, False, remaining

    def _existing(
        self,
        record: OperationRecord,
        new: NewOperation,
        lease_remaining: float,
        wait: timedelta | None,
    ) -> ClaimResult:
        if record.reaped_at is not None:
            raise IdempotencyKeyExpired(
                f"idempotency key {new.idempotency_key!r} is past its retention window",
                operation_id=record.id,
            )
        if record.fingerprint != new.fingerprint:
            raise IdempotencyKeyReused(
                f"idempotency key {new.idempotency_key!r} was first used with other effect "
                "fields; nothing was executed",
                operation_id=record.id,
            )
        if record.state is State.IN_PROGRESS and wait is not None and wait > timedelta(0):
            # Each look counts the replay the wait ends in, like any other replay.
            record = wait_until_settled(self, record, wait, reread=self._reread)
            if record.state is State.IN_PROGRESS and record.lease_expires_at is not None:
                lease_remaining = (record.lease_expires_at - self.db_time()).total_seconds()
        if record.terminal:
            return ClaimResult(operation=record, created=False, replayed=True)
        if record.state is State.OUTCOME_UNKNOWN:
            return ClaimResult(operation=record, created=False)
        raise OperationInProgress(
            f"operation {record.id} is in progress",
            operation_id=record.id,
            retry_after=look_again_after(record, lease_remaining),
        )

    # -- reads ------------------------------------------------------------------------

    def _one(self, *where: sa.ColumnElement[bool]) -> OperationRecord | None:
        def read(conn: Connection) -> OperationRecord | None:
            row = conn.execute(sa.select(operations).where(*where)).mappings().first()
            return OperationRecord.from_row(row) if row is not None else None

        return read_in_transaction(self.engine, read)

    def get(self, tenant_id: str, operation_id: str) -> OperationRecord:
        t = operations.c
        found = self._one(t.tenant_id == tenant_id, t.id == operation_id)
        if found is None:
            raise OperationNotFound(f"no operation {operation_id} for tenant {tenant_id}")
        return found

    def find(self, operation_id: str) -> OperationRecord:
        """Look an operation up by id alone (operator tools; a cross-tenant read)."""
        found = self._one(operations.c.id == operation_id)
        if found is None:
            raise OperationNotFound(f"no operation {operation_id}")
        return found

    def get_by_namespace(self, tenant_id: str, operation: str, key: str) -> OperationRecord:
        t = operations.c
        found = self._one(
            t.tenant_id == tenant_id, t.operation == operation, t.idempotency_key == key
        )
        if found is None:
            raise OperationNotFound(f"no operation {operation} with key {key!r} for {tenant_id}")
        return found

    def find_by_reference(
        self, tenant_id: str, provider: str, reference: str
    ) -> OperationRecord | None:
        t = operations.c
        return self._one(
            t.tenant_id == tenant_id, t.provider == provider, t.provider_reference == reference
        )

    def events(self, tenant_id: str, operation_id: str) -> list[EventRecord]:
        def read(conn: Connection) -> list[EventRecord]:
            rows = conn.execute(
                sa.select(events)
                .where(events.c.tenant_id == tenant_id, events.c.operation_id == operation_id)
                .order_by(events.c.id)
            ).mappings()
            return [EventRecord.from_row(r) for r in rows]

        return read_in_transaction(self.engine, read)

    # -- writes -----------------------------------------------------------------------

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
        error_code: str | None = _UNSET,
        resolution: str | None = _UNSET,
        possibly_sent: bool = _UNSET,
        attempts_delta: int = 0,
        checks_delta: int = 0,
        needs_attention: bool = _UNSET,
        also: Callable[[Connection, OperationRecord], None] | None = None,
        guard: sa.ColumnElement[bool] | None = None,
    ) -> OperationRecord:
        """Move ``record`` to ``to_state`` if nobody wrote it since it was read.

        The UPDATE is fenced by ``version``; its event row shares the transaction. Passing
        ``lease`` (re)takes the lease for ``lease_owner``; otherwise the lease is released.
        ``also`` runs in the same transaction (e.g. the webhook inbox row). ``guard`` is an
        extra condition of the UPDATE, judged by the database at write time; when it fails
        the write is refused like a lost compare-and-set.
        """
        check_transition(record.state, to_state)
        plain: dict[str, Any] = {}
        if provider_reference is not None:  # once known, a reference is never forgotten
            plain["provider_reference"] = provider_reference
        for name, value in (
            ("response", response),
            ("error_code", error_code),
            ("resolution", resolution),
            ("possibly_sent", possibly_sent),
            ("needs_attention", needs_attention),
        ):
            if value is not _UNSET:
                plain[name] = dict(value) if isinstance(value, Mapping) else value
        if lease is not None:
            plain["lease_owner"] = lease_owner
        # Waiters only ever wait on in_progress: notify when an operation leaves it.
        notify = (
            self.is_postgres
            and record.state is State.IN_PROGRESS
            and to_state is not State.IN_PROGRESS
        )
        shape = (
            tuple(sorted(plain)),
            lease is not None,
            next_check_in is not None,
            to_state.terminal,
            bool(attempts_delta),
            bool(checks_delta),
            notify,
        )
        if self.is_postgres and guard is None and also is None:
            event = {"id": new_id(), "kind": kind, "actor": actor, "detail": detail}
            return pg_writes.transition(
                self.engine,
                self._pg_updates,
                record,
                to_state,
                shape=shape,
                plain=plain,
                event=event,
                lease=lease,
                next_check_in=next_check_in,
                attempts_delta=attempts_delta,
                checks_delta=checks_delta,
                channel=NOTIFY_CHANNEL,
            )
        stmt = self._updates.get(shape) if guard is None else None
        if stmt is None:
            stmt = build_update(shape, guard)
            if guard is None:
                self._updates[shape] = stmt
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
            u_channel=NOTIFY_CHANNEL,
        )

        def txn(conn: Connection) -> OperationRecord:
            row = conn.execute(stmt, params).mappings().first()
            if row is None:
                raise StaleVersion(
                    f"operation {record.id} changed since version {record.version}",
                    operation_id=record.id,
                )
            updated = OperationRecord.from_row(row)
            self._add_event(
                conn,
                updated,
                kind=kind,
                actor=actor,
                from_state=record.state,
                to_state=to_state,
                detail=detail,
            )
            if also is not None:
                also(conn, updated)
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
            self._add_event(
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
            self._add_event(
                conn, updated, kind=kind, actor=actor, from_state=None, to_state=None, detail=detail
            )
            return updated

        return run_in_transaction(self.engine, txn)

    def db_time(self) -> datetime:
        """The database's clock now (the one every lease and window is judged by)."""
        return read_in_transaction(
            self.engine, lambda conn: conn.execute(sa.select(db_now())).scalar_one()
        )

    # -- the reconciler's work queue --------------------------------------------------

    def claim_due(
        self,
        *,
        owner: str,
        lease: timedelta,
        limit: int,
        tenant_ids: Collection[str] | None = None,
        quarantine: timedelta = QUARANTINE_HOLD,
        on_quarantine: Callable[[CorruptRecord], None] | None = None,
    ) -> list[tuple[OperationRecord, datetime]]:
        """Lease up to ``limit`` due operations for ``owner``; return them with the DB time.

        Due: ``outcome_unknown`` whose next check has come, or ``in_progress`` whose lease
        expired. PostgreSQL picks with ``FOR UPDATE SKIP LOCKED`` so daemons on many hosts
        take disjoint batches; the lease then keeps others off until it expires.
        ``tenant_ids`` limits the scan to those tenants (a daemon per shard or per tenant).

        A picked row that cannot be read (:class:`CorruptRecord`) is quarantined in the same
        transaction: flagged ``needs_attention``, a ``quarantined`` event, not due again for
        ``quarantine``; it is left out of the batch (``on_quarantine`` hears of it) and the
        rest of the batch is leased as usual.
        """
        t = operations.c
        lease_s = lease.total_seconds()
        corrupt: list[CorruptRecord] = []

        def txn(conn: Connection) -> list[tuple[OperationRecord, datetime]]:
            pick = (
                sa.select(t.tenant_id, t.id, t.version)
                .where(
                    is_active(),  # literals: the partial index's predicate, as written
                    t.next_check_at <= db_now(),
                    sa.or_(t.lease_expires_at.is_(None), t.lease_expires_at <= db_now()),
                    t.tenant_id.in_(sorted(tenant_ids)) if tenant_ids is not None else sa.true(),
                )
                .order_by(t.next_check_at)
                .limit(limit)
            )
            if self.is_postgres:
                pick = pick.with_for_update(skip_locked=True)
            picked = conn.execute(pick).all()
            out: list[tuple[OperationRecord, datetime]] = []
            corrupt.clear()  # a retried transaction starts over
            for tenant_id, op_id, version in picked:
                try:
                    leased = lease_row(
                        conn, tenant_id, op_id, version, owner=owner, lease_s=lease_s
                    )
                except CorruptRecord as exc:
                    # The lease UPDATE applied (version + 1) before the row failed to decode.
                    where = (tenant_id, op_id, version + 1)
                    self._quarantine(conn, exc, where, owner=owner, hold=quarantine)
                    corrupt.append(exc)
                    continue
                if leased is not None:
                    out.append(leased)
            return out

        batch = run_in_transaction(self.engine, txn)
        if on_quarantine is not None:
            for exc in corrupt:
                on_quarantine(exc)
        return batch

    def lease_one(
        self,
        record: OperationRecord,
        *,
        owner: str,
        lease: timedelta,
        kind: str,
        actor: str,
        detail: Mapping[str, Any],
    ) -> tuple[OperationRecord, datetime]:
        """Lease one active operation whose lease is free or expired, with an event.

        Raises StaleVersion if it changed since ``record`` was read or someone holds it, and
        CorruptRecord (after quarantining it, as ``claim_due`` does) if it cannot be read.
        """

        def txn(conn: Connection) -> tuple[OperationRecord, datetime] | CorruptRecord:
            try:
                leased = lease_row(
                    conn,
                    record.tenant_id,
                    record.id,
                    record.version,
                    owner=owner,
                    lease_s=lease.total_seconds(),
                )
            except CorruptRecord as exc:
                where = (record.tenant_id, record.id, record.version + 1)
                self._quarantine(conn, exc, where, owner=owner, hold=QUARANTINE_HOLD)
                return exc  # raised once the quarantine has committed
            if leased is None:
                raise StaleVersion(
                    f"operation {record.id} changed or was leased meanwhile; try again",
                    operation_id=record.id,
                )
            self._add_event(
                conn,
                leased[0],
                kind=kind,
                actor=actor,
                from_state=None,
                to_state=None,
                detail=detail,
            )
            return leased

        result = run_in_transaction(self.engine, txn)
        if isinstance(result, CorruptRecord):
            raise result
        return result

    def release(self, record: OperationRecord) -> None:
        """Give a lease back untouched (graceful shutdown): due again at once."""
        t = operations.c

        def txn(conn: Connection) -> None:
            conn.execute(
                sa.update(operations)
                .where(
                    t.tenant_id == record.tenant_id,
                    t.id == record.id,
                    t.version == record.version,
                )
                .values(
                    lease_owner=None,
                    lease_expires_at=None,
                    next_check_at=db_now(),
                    version=t.version + 1,
                    updated_at=db_now(),
                )
            )

        run_in_transaction(self.engine, txn)

    def renew_lease(
        self, record: OperationRecord, *, owner: str, lease: timedelta
    ) -> tuple[OperationRecord, datetime]:
        """Restart ``owner``'s lease on ``record`` (``lease`` from now); with the DB time.

        Fenced by version and owner, even when the lease has lapsed: a lapsed lease nobody
        took meanwhile is still ours. Raises StaleVersion if anyone else wrote it.
        """
        t = operations.c
        renew = (
            sa.update(operations)
            .where(
                t.tenant_id == record.tenant_id,
                t.id == record.id,
                t.version == record.version,
                t.lease_owner == owner,
                t.state.in_(("in_progress", "outcome_unknown")),
            )
            .values(
                lease_expires_at=db_now_plus(sa.literal(lease.total_seconds())),
                version=t.version + 1,
                updated_at=db_now(),
            )
            .returning(*operations.c, db_now().label("_now"))
        )

        def txn(conn: Connection) -> tuple[OperationRecord, datetime]:
            row = conn.execute(renew).mappings().first()
            if row is None:
                raise StaleVersion(f"operation {record.id} changed", operation_id=record.id)
            return OperationRecord.from_row(row), row["_now"]

        return run_in_transaction(self.engine, txn)

    # -- waiting ----------------------------------------------------------------------

    def wait_until_settled(self, record: OperationRecord, wait: timedelta) -> OperationRecord:
        """Wait up to ``wait`` for ``record`` to leave ``in_progress``; return it as it is then.

        PostgreSQL waiters sleep on LISTEN/NOTIFY; SQLite waiters poll with backoff.
        """
        return wait_until_settled(self, record, wait)

    # -- helpers ----------------------------------------------------------------------

    def _quarantine(
        self,
        conn: Connection,
        exc: CorruptRecord,
        where: tuple[str, str, int],
        *,
        owner: str,
        hold: timedelta,
    ) -> None:
        """Set an unreadable row aside: flagged, lease released, next check after ``hold``.

        Only the columns this writes are touched; the corrupt ones stay as evidence for
        whoever repairs the row. ``where`` (tenant, id, version) fences it to the lease just
        taken, by the values the pick read rather than what the broken row decoded to.
        """
        t = operations.c
        tenant_id, op_id, version = where
        moved = conn.execute(
            sa.update(operations)
            .where(
                t.tenant_id == tenant_id,
                t.id == op_id,
                t.version == version,
                t.lease_owner == owner,
            )
            .values(
                needs_attention=True,
                lease_owner=None,
                lease_expires_at=None,
                next_check_at=db_now_plus(sa.literal(hold.total_seconds())),
                version=t.version + 1,
                updated_at=db_now(),
            )
        )
        if moved.rowcount != 1:  # pragma: no cover - the lease was taken in this transaction
            return
        conn.execute(
            EVENT_INSERT,
            {
                "e_tenant_id": tenant_id,
                "e_id": new_id(),
                "e_operation_id": op_id,
                "e_kind": QUARANTINE_EVENT,
                "e_actor": owner,
                "e_from_state": None,
                "e_to_state": None,
                "e_version": None,
                "e_detail": {"error": type(exc).__name__, "problem": exc.problem},
            },
        )

    def _reread(self, record: OperationRecord) -> OperationRecord:
        """``record`` as it is now, its replay counted if it is terminal (a waiter's look):
        one statement on PostgreSQL."""
        if self.is_postgres:
            return pg_writes.reread(self.engine, record)

        def txn(conn: Connection) -> OperationRecord:
            counted = self._count_replay(conn, record)
            if counted is not None:
                return counted
            row = (
                conn.execute(
                    sa.select(operations).where(
                        operations.c.tenant_id == record.tenant_id,
                        operations.c.id == record.id,
                    )
                )
                .mappings()
                .one()
            )
            return OperationRecord.from_row(row)

        return run_in_transaction(self.engine, txn)

    def _count_replay(self, conn: Connection, record: OperationRecord) -> OperationRecord | None:
        """Count one replay of ``record`` (terminal, not reaped); the row as it is now."""
        row = (
            conn.execute(
                REPLAY_BY_ID,
                {
                    "r_tenant_id": record.tenant_id,
                    "r_id": record.id,
                    "r_fingerprint": record.fingerprint,
                },
            )
            .mappings()
            .first()
        )
        return OperationRecord.from_row(row) if row is not None else None

    def _insert(self, table: sa.Table) -> Any:
        return postgresql.insert(table) if self.is_postgres else sqlite.insert(table)

    def _add_event(
        self,
        conn: Connection,
        record: OperationRecord,
        *,
        kind: str,
        actor: str,
        from_state: State | None,
        to_state: State | None,
        detail: Mapping[str, Any] | None,
    ) -> None:
        conn.execute(
            EVENT_INSERT,
            {
                "e_tenant_id": record.tenant_id,
                "e_id": new_id(),
                "e_operation_id": record.id,
                "e_kind": kind,
                "e_actor": actor,
                "e_from_state": from_state.value if from_state else None,
                "e_to_state": to_state.value if to_state else None,
                "e_version": record.version if to_state is not None else None,
                "e_detail": dict(detail) if detail is not None else None,
            },
        )


def _claim_uncertain(new: NewOperation, op_id: str) -> CommitUncertain:
    # Our claim may be durable: the operation may exist, and the reconciler may send it.
    # Only a retry with the same key can tell, never a new key.
    return CommitUncertain(
        f"the claim of idempotency key {new.idempotency_key!r} may have committed "
        f"as operation {op_id}; retry with the same key later",
        operation_id=op_id,
        retry_after=1.0,
    )


def _duplicate_kind(existing: OperationRecord, new: NewOperation) -> str | None:
    if existing.reaped_at is not None:
        return "expired_key_used"
    if existing.fingerprint != new.fingerprint:
        return "key_reused"
    if existing.terminal:
        return "replayed"
    return None
