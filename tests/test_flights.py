"""Identical requests waiting together in one process share one leader's trip.

Joiners answer with the leader's outcome, as replays counted on the row, and never reach
the provider; a request that differs, or whose wait ends first, takes the usual path and
gets exactly the answer the database gives it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import sqlalchemy as sa

from payorch.core import State
from payorch.errors import IdempotencyKeyReused, OperationInProgress
from payorch.execution._executor import Executor
from payorch.execution._flights import Flights
from payorch.operations import default_registry
from payorch.outcome import Outcome
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.records import OperationRecord
from payorch.storage._store import Store
from payorch.storage._tables import operations

PAYMENT = {"amount": 1500, "currency": "EUR", "customer": "cus_flight"}


# Flights are PostgreSQL's (SQLite serves one process's writers one at a time anyway).
on_postgres = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


@pytest.fixture
def patient_provider(sandbox: SandboxServer) -> Iterator[SandboxProvider]:
    # The winner is held at the provider while the others arrive: its read must outlast it.
    timeout = httpx.Timeout(connect=1.0, read=60.0, write=1.0, pool=1.0)
    with SandboxProvider(base_url=sandbox.url, timeout=timeout) as provider:
        yield provider


def executor(store: Store, provider: SandboxProvider) -> Executor:
    return Executor(
        store=store,
        providers=[provider],
        registry=default_registry("sandbox"),
        lease=timedelta(minutes=5),
        owner="flights",
    )


def pay(ex: Executor, key: str, wait: float | None, **change: object) -> Outcome:
    return ex.execute(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key=key,
        request={**PAYMENT, **change},
        wait=timedelta(seconds=wait) if wait is not None else None,
    )


def replays(store: Store, operation_id: str) -> int:
    with store.engine.connect() as conn:
        q = sa.select(operations.c.replays).where(operations.c.id == operation_id)
        return int(conn.execute(q).scalar_one())


@contextmanager
def leader_at_the_provider(
    ex: Executor, sandbox: SandboxServer, key: str
) -> Iterator[tuple[ThreadPoolExecutor, Future[Outcome], Callable[[], None]]]:
    """The first request for ``key`` (wait 60 s) held at the provider: the pool to send
    others from, the leader's future, and what releases it."""
    with sandbox.hold_commits() as gate, ThreadPoolExecutor(8) as pool:
        leader = pool.submit(pay, ex, key, 60)
        assert gate.wait_held(1, timeout=30)
        yield pool, leader, gate.release


@on_postgres
def test_joiners_answer_with_the_leaders_outcome_and_a_changed_request_is_refused(
    store: Store, sandbox: SandboxServer, patient_provider: SandboxProvider
) -> None:
    ex = executor(store, patient_provider)
    with leader_at_the_provider(ex, sandbox, "k1") as (pool, winner, release):
        joiners = [pool.submit(pay, ex, "k1", 60) for _ in range(5)]
        assert ex.flights.wait_for_joiners(5, timeout=30)
        # The same key with another amount does not join: the database refuses it, now.
        with pytest.raises(IdempotencyKeyReused):
            pay(ex, "k1", 60, amount=999)
        release()
        won = winner.result(timeout=60)
        answers = [j.result(timeout=60) for j in joiners]

    assert (won.state, won.replayed) == (State.SUCCEEDED, False)
    assert {(a.operation_id, a.state, a.replayed, a.provider_reference) for a in answers} == {
        (won.operation_id, State.SUCCEEDED, True, won.provider_reference)
    }
    assert replays(store, won.operation_id) == 5
    assert len(sandbox.ledger()) == 1
    kinds = [e.kind for e in store.events("shop", won.operation_id)]
    assert kinds.count("key_reused") == 1


@on_postgres
def test_a_joiner_whose_wait_ends_first_takes_the_usual_path(
    store: Store, sandbox: SandboxServer, patient_provider: SandboxProvider
) -> None:
    ex = executor(store, patient_provider)
    with leader_at_the_provider(ex, sandbox, "k2") as (pool, winner, release):
        # Gives up on the flight, asks the database with what is left: still in progress.
        with pytest.raises(OperationInProgress) as caught:
            pay(ex, "k2", 0.2)
        assert caught.value.retry_after is not None
        patient = pool.submit(pay, ex, "k2", 60)
        assert ex.flights.wait_for_joiners(1, timeout=30)
        release()
        won, answer = winner.result(timeout=60), patient.result(timeout=60)

    assert (answer.operation_id, answer.replayed) == (won.operation_id, True)
    assert replays(store, won.operation_id) == 1  # the one that left is not counted
    assert len(sandbox.ledger()) == 1


@on_postgres
def test_requests_without_wait_never_join(
    store: Store, sandbox: SandboxServer, patient_provider: SandboxProvider
) -> None:
    ex = executor(store, patient_provider)
    with leader_at_the_provider(ex, sandbox, "k3") as (_pool, winner, release):
        with pytest.raises(OperationInProgress):
            pay(ex, "k3", None)  # an answer now, the database's: it does not join
        release()
        won = winner.result(timeout=60)
    assert won.state is State.SUCCEEDED
    assert len(sandbox.ledger()) == 1


def _record(state: State) -> OperationRecord:
    now = datetime.now(UTC)
    terminal = state.terminal
    return OperationRecord(
        tenant_id="t",
        id="op-1",
        operation="payment.create",
        idempotency_key="k",
        fingerprint="f" * 64,
        state=state,
        provider="sandbox",
        downstream_key="dk",
        provider_reference=None,
        amount=100,
        currency="EUR",
        request={},
        response=None,
        error_code=None,
        resolution=None,
        attempts=1,
        checks=0,
        possibly_sent=True,
        needs_attention=False,
        lease_owner=None,
        lease_expires_at=None,
        next_check_at=None,
        version=2,
        created_at=now,
        updated_at=now,
        completed_at=now if terminal else None,
        retain_until=None,
        reaped_at=None,
        retention_seconds=60,
    )


@pytest.mark.parametrize(
    ("landed", "shared", "counted"),
    [
        (None, False, 0),  # the leader raised: each joiner asks the database itself
        (State.IN_PROGRESS, False, 0),  # not an answer worth sharing
        (State.OUTCOME_UNKNOWN, True, 0),  # shared, not a replay: nothing counted
        (State.SUCCEEDED, True, 2),  # a replay each, counted once by the first to wake
    ],
)
def test_what_a_landing_gives_its_joiners(landed: State | None, shared: bool, counted: int) -> None:
    flights = Flights()
    ns = ("t", "payment.create", "k")
    flight, leading = flights.lead_or_join(ns, "fp", may_join=True)
    assert flight is not None and leading
    assert flights.lead_or_join(ns, "other", may_join=True) == (None, False)
    assert flights.lead_or_join(ns, "fp", may_join=False) == (None, False)
    for _ in range(2):
        assert flights.lead_or_join(ns, "fp", may_join=True) == (flight, False)
    record = _record(landed) if landed is not None else None
    flights.land(ns, flight, record)
    first, second = flights.wait(flight, 0), flights.wait(flight, 0)
    assert (first[0] is not None, first[1] + second[1]) == (shared, counted)
    # Landed: the next request leads a new flight.
    assert flights.lead_or_join(ns, "fp", may_join=True)[1] is True
