"""``execute()``: claim -> (row and downstream key durable) -> submit -> classify -> record.

The claim commits the operation, its lease and its downstream key, and marks the first
attempt as possibly sent, before a byte goes to the provider: a crash at any point after
that leaves an operation the reconciler can finish from evidence.
"""

from __future__ import annotations

import functools
import math
import os
import random
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

from pydantic import BaseModel

from ..core import State, max_backoff_total, validate_key_scope
from ..errors import (
    ConfigurationError,
    IdempotencyKeyExpired,
    NoRoute,
    OperationNotFound,
    OutcomeNotRecorded,
    ProviderUnavailable,
    StorageError,
    UnknownProvider,
)
from ..forks import reset_in_child
from ..observing import _logs as logs
from ..observing import _metrics as metrics
from ..observing import _routing as routing_metrics
from ..observing import _tracing as tracing
from ..operations import Prepared, Registry, default_registry
from ..outcome import Outcome
from ..provider import Provider, WireRequest
from ..records import OperationRecord
from ..routing import Router, key_at
from ..storage import _route_keys as route_keys
from ..storage._bridge import bridged
from ..storage._store import Store
from ._attempts import RetryPolicy, kept_for, submit_and_record, wire_of
from ._flights import Flight, Flights
from ._routes import fallback_for, routed

__all__ = [
    "Executor",
    "RetryPolicy",
    "default_owner",
    "owner_of_this_process",
    "submit_and_record",
]


def default_owner(role: str = "executor") -> str:
    """A lease owner name that says which process held it."""
    return f"{role}:{socket.gethostname()}:{os.getpid()}"


def owner_of_this_process(holder: Any, role: str) -> str:
    """:func:`default_owner` for ``holder.owner``, renamed in every forked child: the owner
    fences leases, and sibling workers must not share one."""
    reset_in_child(holder, functools.partial(_rename, role=role))
    return default_owner(role)


def _rename(holder: Any, *, role: str) -> None:
    holder.owner = default_owner(role)


_DEFAULT_LEASE = timedelta(seconds=60)


def _whole_seconds(span: timedelta) -> timedelta:
    return timedelta(seconds=math.ceil(span.total_seconds()))


class Executor:
    """Runs payment operations through their provider, exactly once per namespace.

    ``lease`` (how long a claim is this executor's before the reconciler may take it over)
    must outlast one ``execute()`` on every adapter, inline retries included: shorter is
    refused. Left out, it is that worst case (at least 60 s), so any adapter's time-outs
    fit; a crashed process's operation then waits that long for the reconciler.
    """

    def __init__(
        self,
        *,
        store: Store,
        providers: Iterable[Provider],
        registry: Registry | None = None,
        lease: timedelta | None = None,
        retry: RetryPolicy | None = None,
        owner: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rand: Callable[[], float] = random.random,
        key_scope: str | None = None,
        router: Router | None = None,
    ) -> None:
        self.store = store
        # None: the environment's (PAYORCH_KEY_SCOPE), so the CLI, the integrations and the
        # app's own executors agree; only that variable is read (others are not ours here).
        self.key_scope = validate_key_scope(
            os.environ.get("PAYORCH_KEY_SCOPE", "") if key_scope is None else key_scope
        )
        self.providers: dict[str, Provider] = {}
        for p in providers:
            if p.name in self.providers:
                raise ConfigurationError(f"two providers named {p.name!r}")
            self.providers[p.name] = p
        self.registry = registry or default_registry()
        # Routing (payorch.routing): a rule naming a provider not given here, or a split
        # that cannot be, refuses start-up.
        if router is not None:
            router.check(self.providers, self.registry.types)
        self.router = router
        self.retry = retry or RetryPolicy()
        if lease is None:
            # The adapters' worst case: one execute() with every inline retry, on the
            # slowest of them (whole seconds, at least the former default of 60 s).
            worst = max((self.lease_needed(p) for p in self.providers.values()), default=None)
            lease = max(_DEFAULT_LEASE, _whole_seconds(worst) if worst else _DEFAULT_LEASE)
        self.lease = lease
        self.owner = owner or owner_of_this_process(self, "executor")
        self._sleep = sleep
        self._rand = rand
        # Identical requests waiting together in this process share one leader's trip.
        self.flights = Flights()
        for p in self.providers.values():
            needed = self.lease_needed(p)
            if lease < needed:
                raise ConfigurationError(
                    f"lease {lease.total_seconds():g}s is shorter than the worst case of one "
                    f"execute() on {p.name!r} ({needed.total_seconds():g}s: "
                    f"{self.retry.max_attempts} attempts x "
                    f"{p.max_call_duration.total_seconds():g}s plus backoff); "
                    "raise the lease or lower the time-outs"
                )

    def lease_needed(self, provider: Provider) -> timedelta:
        r = self.retry
        sleeping = max_backoff_total(r.max_attempts - 1, base=r.base_delay, cap=r.max_delay)
        return provider.max_call_duration * r.max_attempts + timedelta(seconds=sleeping + 1.0)

    def provider(self, name: str) -> Provider:
        """The adapter for a provider name a caller gave; ``UnknownProvider`` (4xx) if none."""
        try:
            return self.providers[name]
        except KeyError:
            raise UnknownProvider(f"no provider named {name!r} is configured") from None

    @metrics.counts_executions  # what raises; what returns is counted below
    @tracing.instrumented_execute
    def execute(
        self,
        *,
        tenant_id: str,
        operation: str,
        idempotency_key: str,
        request: Mapping[str, Any] | BaseModel,
        provider: str | None = None,
        wait: timedelta | None = None,
    ) -> Outcome:
        """Run one operation or return what its namespace already holds.

        Raises ``InvalidRequest`` subclasses (nothing written; ``UnknownProvider`` for a
        ``provider`` this executor lacks), ``IdempotencyKeyReused``, ``IdempotencyKeyExpired``
        and ``OperationInProgress`` (unless ``wait`` covers it). ``ProviderUnavailable``
        (503): every attempt was certainly not sent, nothing is stored as the key's answer,
        and the same key runs again on the next call. Storage failures: a plain
        ``StorageError`` before the claim can have committed; ``OutcomeNotRecorded`` once it
        may have (the operation may exist and may have been sent). Both mean "retry the
        same key"; neither permits a new one.

        On PostgreSQL, a call with ``wait`` that finds an identical call (same namespace and
        fingerprint) under way in this executor joins it and answers with its outcome
        (:mod:`payorch.execution._flights`) instead of claiming and waiting on the database itself.
        """
        started = time.perf_counter()
        prepared = self.registry.prepare(
            tenant_id=tenant_id,
            operation=operation,
            idempotency_key=idempotency_key,
            request=request,
            provider=provider,
            key_scope=self.key_scope,
        )
        if not provider and self.router is not None and self.router.routes(operation):
            # Chosen before anything is stored; a request no rule matches stores nothing.
            prepared = self._routed(prepared)
            adapter = self.providers[prepared.new.provider]
        elif provider:  # as prepare() reads it: an empty name means the type's default
            adapter = self.provider(provider)
        elif prepared.new.provider in self.providers:
            adapter = self.providers[prepared.new.provider]
        else:
            # Not the caller's fault: the operation type's default is not configured here.
            raise ConfigurationError(
                f"operation {operation!r} defaults to provider {prepared.new.provider!r}, "
                "which this executor was not given"
            )
        seen = metrics.for_execution(prepared.new.operation, adapter.name)
        new = prepared.new
        namespace = (new.tenant_id, new.operation, new.idempotency_key)
        flight, leading = None, False
        if self.store.is_postgres and not bridged():
            may_join = wait is not None and wait > timedelta(0)
            flight, leading = self.flights.lead_or_join(
                namespace, new.fingerprint, may_join=may_join
            )
        if flight is not None and not leading:
            assert wait is not None
            waited = time.monotonic()
            shared = self._join(flight, wait)
            if shared is not None:
                seen.finished("replayed" if shared.replayed else "existing", started)
                return shared
            wait = max(timedelta(0), wait - timedelta(seconds=time.monotonic() - waited))
        answered: OperationRecord | None = None
        unavailable: ProviderUnavailable | None = None
        try:
            answered, replayed = self._execute(prepared, adapter, seen, started, wait)
            return Outcome.from_record(answered, replayed=replayed)
        except ProviderUnavailable as exc:
            unavailable = exc
            raise
        finally:
            if leading and flight is not None:
                self.flights.land(namespace, flight, answered, unavailable)

    def _routed(self, prepared: Prepared) -> Prepared:
        """``prepared`` with its route; ``NoRoute`` only for a namespace never stored: the
        routing table may have changed since a stored one was routed, and its retry is
        answered from it (a replay, the unknown as it stands), never "fix the request"."""
        assert self.router is not None
        try:
            return routed(prepared, self.router, self.key_scope)
        except NoRoute as refused:
            new = prepared.new
            try:
                stored = self.store.get_by_namespace(
                    new.tenant_id, new.operation, new.idempotency_key
                )
            except OperationNotFound:
                raise refused from None  # nothing stored, and nothing will be
            if stored.provider not in self.providers:
                raise ConfigurationError(
                    f"operation {stored.id} stands at provider {stored.provider!r}, which "
                    "this executor was not given: retry the same key"
                ) from None
            route = stored.route if stored.route is not None else None
            return replace(prepared, new=replace(new, provider=stored.provider, route=route))

    def _join(self, flight: Flight, wait: timedelta) -> Outcome | None:
        """A joiner's answer: the leader's, a replay if settled; None: take the usual path."""
        record, to_count = self.flights.wait(flight, wait.total_seconds())
        if flight.unavailable is not None:
            said = flight.unavailable  # a copy each: joiners raise in their own threads
            raise ProviderUnavailable(
                said.message,
                operation_id=said.operation_id,
                retry_after=said.retry_after,
                code=said.code,
            )
        if record is None:
            return None
        if to_count:
            try:
                self.store.count_replays(record, to_count)
            except StorageError as exc:  # a count in doubt is no reason to fail an answer
                logs.executor_log.warning("replays of %s not counted: %s", record.id, exc)
        return Outcome.from_record(record, replayed=record.terminal)

    def _execute(
        self,
        prepared: Prepared,
        adapter: Provider,
        seen: metrics.Recorder,
        started: float,
        wait: timedelta | None,
    ) -> tuple[OperationRecord, bool]:
        """The claim, and the provider call if it created the operation: the record to
        answer with, and whether that answer is a replay."""
        claiming = time.perf_counter()
        wire = wire_of(prepared, adapter)
        new = prepared.new if wire is None else replace(prepared.new, wire=wire.stored())
        try:
            with tracing.claim(adapter.name) as span:
                claim = self.store.claim(
                    new, owner=self.owner, lease=self.lease, possibly_sent=True, wait=wait
                )
                tracing.set_attributes(span, created=claim.created, replayed=claim.replayed)
        except IdempotencyKeyExpired as exc:
            exc.http_status = prepared.type.expired_status
            raise
        seen.claimed(time.perf_counter() - claiming)
        if not claim.created:
            seen.finished("replayed" if claim.replayed else "existing", started)
            return claim.operation, claim.replayed
        op_id = claim.operation.id
        self._note_skipped(claim.operation)
        try:
            record = self._submit(prepared, adapter, claim.operation, wire)
        except OutcomeNotRecorded as exc:
            exc.operation_id = exc.operation_id or op_id
            raise
        except StorageError as exc:
            # The claim is durable and the request may have reached the provider: this is
            # never "nothing happened". The lease expires, the reconciler finds the truth.
            raise OutcomeNotRecorded(
                f"operation {op_id} may have reached the provider, but its outcome could not "
                f"be recorded ({exc.message}); retry with the same key later",
                operation_id=op_id,
                retry_after=exc.retry_after,
            ) from exc
        if record.released:
            # Certainly not sent: nothing stored as this key's answer; the same key runs again.
            raise _not_sent(record)
        seen.finished("fresh", started, record.state)
        return record, False

    def _submit(
        self,
        prepared: Prepared,
        adapter: Provider,
        record: OperationRecord,
        wire: WireRequest | None,
    ) -> OperationRecord:
        """Send the claimed ``record`` and record its answer; a routed one moves on to its
        next provider as long as each attempt is proven not to have executed."""
        visited: set[str] = set()
        built: dict[str, WireRequest | None] = {}

        def wire_at(name: str) -> WireRequest | None:
            """What provider ``name`` is sent: built once, kept with the move and sent."""
            if name not in built:
                built[name] = wire_of(_at(prepared, name), self.providers[name])
            return built[name]

        if record.route is not None:
            if record.provider not in self.providers:
                raise self._not_here(record)
            adapter = self.providers[record.provider]  # a take-over resumes where it stood
        while True:
            visited.add(adapter.name)
            fallback = fallback_for(record, self.router, visited, self.providers)
            if fallback is not None:
                fallback = replace(fallback, wire=functools.partial(_stored, wire_at, fallback.to))
            if record.route is not None:
                routing_metrics.attempted(adapter.name)
            record = submit_and_record(
                self.store,
                adapter,
                record,
                prepared.payload,
                owner=self.owner,
                lease=self.lease,
                retry=self.retry,
                sleep=self._sleep,
                rand=self._rand,
                # Nothing hidden in the stored copy: nothing for Redactor.of to find there
                # (its walk skipped); otherwise (None) it is derived as ever.
                redactor=prepared.redactor,
                # The bytes the claim kept are the bytes sent, whatever submit would build;
                # a take-over of an operation first claimed under another key sends afresh.
                wire=wire if kept_for(wire, record) else None,
                router=self.router if record.route is not None else None,
                fallback=fallback,
            )
            moved = (
                fallback is not None
                and record.provider == fallback.to
                and record.state is State.IN_PROGRESS
                and record.lease_owner == self.owner
            )
            if not moved:
                return record
            adapter = self.providers[record.provider]
            wire = wire_at(record.provider)

    def _note_skipped(self, record: OperationRecord) -> None:
        """A route that passed a provider over as unhealthy is noted (``route_skipped``),
        so the daemon's look asks that provider too: a claim lost in a failover may have
        been sent there. Only a new route's; a note that cannot be written is logged."""
        skipped = (record.route or {}).get("skipped")
        if not skipped or record.version != 1:  # a take-over's route was noted when new
            return
        try:
            # The key each one would have been sent under: a webhook or a report row
            # naming it finds this operation (payorch_route_keys).
            keys = {str(p): key_at(record.route or {}, str(p)) or "" for p in skipped}
            self.store.append_event(
                record,
                kind="route_skipped",
                actor=self.owner,
                detail={"skipped": skipped, "keys": keys},
                also=route_keys.remember(self.store, list(keys.items())),
            )
        except StorageError as exc:
            logs.executor_log.warning("route of %s not noted: %s", record.id, exc)

    def _not_here(self, record: OperationRecord) -> ConfigurationError:
        """A routed operation taken over at a provider this executor lacks: nothing was
        sent, so it is released again (the namespace's next request, on an executor that
        has the provider, runs it) and the configuration is named."""
        self.store.transition(
            record,
            State.IN_PROGRESS,
            kind="not_sent",
            actor=self.owner,
            detail={"reason": f"provider {record.provider!r} is not configured here"},
            possibly_sent=False,
        )
        return ConfigurationError(
            f"operation {record.id} stands at provider {record.provider!r}, which this "
            "executor was not given; nothing was sent: retry the same key"
        )


def _stored(
    wire_at: Callable[[str], WireRequest | None], provider: str
) -> Mapping[str, Any] | None:
    """The request ``provider`` will be sent, as a move keeps it."""
    built = wire_at(provider)
    return built.stored() if built is not None else None


def _at(prepared: Prepared, provider: str) -> Prepared:
    """``prepared`` as sent to ``provider`` (its own downstream key)."""
    return replace(prepared, new=replace(prepared.new, provider=provider))


def _not_sent(record: OperationRecord) -> ProviderUnavailable:
    code = record.error_code or "provider_unavailable"
    said = (record.response or {}).get("retry_after")
    # The provider's own Retry-After (60 s for refused credentials) when it gave one.
    retry_after = float(said) if isinstance(said, int | float) and said > 0 else None
    return ProviderUnavailable(
        f"operation {record.id}: no attempt reached provider {record.provider!r} ({code}); "
        "nothing was charged: retry with the same idempotency key after Retry-After seconds",
        operation_id=record.id,
        retry_after=retry_after,
        code=code,
    )
