"""Round trips per operation on PostgreSQL, counted where they happen.

Two counts: the statements the driver is asked to run (a recording psycopg cursor) and
the round trips the driver really makes, seen at a loopback TCP proxy that reads the
frontend protocol: every simple Query and every Sync is one round trip, so a BEGIN, a
COMMIT or a pool pre-ping shows there even where no cursor sees it.

A fresh operation is two (the claim with its event; the outcome with its event and
NOTIFY), a replay one. A storm of duplicates waiting with ``wait=`` costs each loser a
bounded handful of statements, and makes one effect.
"""

from __future__ import annotations

import asyncio
import select
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import pytest
import sqlalchemy as sa
from conftest import RecordingSleep
from pgproxy import LoopbackProxy

from payorch.core import State
from payorch.execution._async import AsyncExecutor
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.outcome import Outcome
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.storage import _sessions as sessions
from payorch.storage import _waiting as waiting
from payorch.storage._async_store import AsyncStore
from payorch.storage._store import Store
from payorch.storage._tables import operations

PAYMENT = {"amount": 1500, "currency": "EUR", "customer": "cus_rt"}
_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104


class CountingProxy(LoopbackProxy):
    """Forwards 127.0.0.1 connections to PostgreSQL; counts the client's round trips."""

    def __init__(self, host: str, port: int) -> None:
        self.messages: Counter[bytes] = Counter()  # frontend message types, after start-up
        super().__init__(host, port)

    @property
    def round_trips(self) -> int:
        with self._lock:
            return self.messages[b"Q"] + self.messages[b"S"]

    def reset(self) -> None:
        with self._lock:
            self.messages.clear()

    def on_client(self, flow: dict[str, Any], data: bytes) -> None:
        flow["pending"], flow["started"] = self._count(
            flow.get("pending", b"") + data, flow.get("started", False)
        )

    def _count(self, buf: bytes, started: bool) -> tuple[bytes, bool]:
        """Count the complete messages in ``buf``; return what is left and the phase."""
        while True:
            if not started:  # untyped: SSL/GSS requests, then the start-up message
                if len(buf) < 4:
                    return buf, started
                (length,) = struct.unpack("!I", buf[:4])
                if len(buf) < length:
                    return buf, started
                code = struct.unpack("!I", buf[4:8])[0] if length >= 8 else 0
                started = code not in (_SSL_REQUEST, _GSSENC_REQUEST)
                buf = buf[length:]
                continue
            if len(buf) < 5:
                return buf, started
            (length,) = struct.unpack("!I", buf[1:5])
            if len(buf) < 1 + length:
                return buf, started
            with self._lock:
                self.messages[buf[:1]] += 1
            buf = buf[1 + length :]


@pytest.fixture
def proxy(postgres_url: str) -> Iterator[CountingProxy]:
    url = sa.make_url(postgres_url)
    p = CountingProxy(url.host or "127.0.0.1", url.port or 5432)
    try:
        yield p
    finally:
        p.close()


class Statements:
    """What the driver was asked to run, per thread, while recording.

    Counted at psycopg's cursor (its ``cursor_factory``): the hot statements run on the
    driver connection itself, where SQLAlchemy's statement listeners do not see them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recording = False
        self.sent: list[tuple[int, str]] = []
        statements = self

        class Recording(psycopg.Cursor[Any]):
            def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
                statements._record(str(query))
                return super().execute(query, params, **kwargs)

        self.connect_args: dict[str, Any] = {"cursor_factory": Recording}

    def _record(self, statement: str) -> None:
        if statement == sessions.ROLE_SQL:
            return  # once per new connection (is it a read-write primary?), like its start-up
        with self._lock:
            if self._recording:
                self.sent.append((threading.get_ident(), statement))

    def __enter__(self) -> Statements:
        with self._lock:
            self.sent.clear()
            self._recording = True
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._recording = False

    def by(self, thread: int) -> list[str]:
        with self._lock:
            return [s for t, s in self.sent if t == thread]


def recorded_store(url: str, statements: Statements, **engine_kwargs: Any) -> Store:
    store = Store.from_url(url, connect_args=statements.connect_args, **engine_kwargs)
    with store.engine.connect():
        pass  # the dialect's first-connect queries run now, before anything is counted
    return store


@pytest.fixture
def statements() -> Statements:
    return Statements()


@pytest.fixture
def counted_store(
    proxy: CountingProxy, postgres_url: str, statements: Statements
) -> Iterator[Store]:
    # One connection: what it sends is all the store sends.
    url = proxy.url(postgres_url)
    store = recorded_store(url, statements, pool_size=1, max_overflow=0)
    try:
        yield store
    finally:
        store.close()


def executor_for(
    store: Store, provider: SandboxProvider, lease: timedelta = timedelta(seconds=30)
) -> Executor:
    return Executor(
        store=store,
        providers=[provider],
        registry=default_registry("sandbox"),
        lease=lease,
        sleep=RecordingSleep(),
        owner="round-trips",
    )


def pay(ex: Executor, key: str, wait: timedelta | None = None) -> Outcome:
    return ex.execute(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key=key,
        request=PAYMENT,
        wait=wait,
    )


def counted(
    proxy: CountingProxy, statements: Statements, call: Callable[[], Outcome]
) -> tuple[Outcome, int, list[str]]:
    """Run ``call``; its outcome, the round trips the driver made, the statements sent."""
    proxy.reset()
    with statements as seen:
        out = call()
    return out, proxy.round_trips, [s for _, s in seen.sent]


def test_a_fresh_operation_is_two_round_trips_and_a_replay_one(
    proxy: CountingProxy,
    counted_store: Store,
    statements: Statements,
    sandbox: SandboxServer,
    sandbox_provider: SandboxProvider,
) -> None:
    ex = executor_for(counted_store, sandbox_provider)
    # Warm: the connection is open and psycopg has prepared the statements it repeats (a
    # one-off round trip per statement and connection, on the fifth use).
    for i in range(8):
        pay(ex, f"warm-{i}")
        pay(ex, f"warm-{i}")
    assert proxy.connections == 1

    fresh, trips, sent = counted(proxy, statements, lambda: pay(ex, "fresh-1"))
    assert (fresh.state, fresh.replayed) == (State.SUCCEEDED, False)
    assert len(sent) <= 2, sent  # the claim + event; the outcome + event + NOTIFY
    assert trips <= 2, proxy.messages  # no BEGIN, no COMMIT, no pre-ping

    again, trips, sent = counted(proxy, statements, lambda: pay(ex, "fresh-1"))
    assert (again.state, again.replayed, again.operation_id) == (
        State.SUCCEEDED,
        True,
        fresh.operation_id,
    )
    assert len(sent) <= 1, sent
    assert trips <= 1, proxy.messages

    # What the two statements wrote: the operation, its two events, the counted replay.
    events = counted_store.events("shop", fresh.operation_id)
    assert [e.kind for e in events] == ["claimed", "provider_answer"]
    with counted_store.engine.connect() as conn:
        replays = conn.execute(
            sa.select(operations.c.replays).where(operations.c.id == fresh.operation_id)
        ).scalar_one()
    assert replays == 1
    assert len(sandbox.ledger()) == 9


def test_the_async_api_makes_the_same_round_trips(
    proxy: CountingProxy,
    postgres_url: str,
    sandbox: SandboxServer,
    sandbox_provider: SandboxProvider,
) -> None:
    """AsyncExecutor on psycopg's async driver: the same two round trips for a fresh
    operation and one for a replay, the same events, one effect each."""

    async def run() -> tuple[list[int], Outcome, Outcome, int]:
        # One connection, as above: what it sends is all the store sends.
        store = AsyncStore.from_url(proxy.url(postgres_url), pool_size=1, max_overflow=0)
        ex = AsyncExecutor(
            store=store,
            providers=[sandbox_provider],
            registry=default_registry("sandbox"),
            lease=timedelta(seconds=30),
            owner="round-trips-async",
        )

        async def apay(key: str) -> Outcome:
            return await ex.execute(
                tenant_id="shop",
                operation="payment.create",
                idempotency_key=key,
                request=PAYMENT,
            )

        try:
            for i in range(8):  # warm: connected, statements prepared (as above)
                await apay(f"awarm-{i}")
                await apay(f"awarm-{i}")
            trips = []
            proxy.reset()
            fresh = await apay("afresh-1")
            trips.append(proxy.round_trips)
            proxy.reset()
            again = await apay("afresh-1")
            trips.append(proxy.round_trips)
            return trips, fresh, again, proxy.connections
        finally:
            await sandbox_provider.aclose()
            await store.close()

    trips, fresh, again, connections = asyncio.run(run())
    assert connections == 1
    assert (fresh.state, fresh.replayed) == (State.SUCCEEDED, False)
    assert (again.state, again.replayed, again.operation_id) == (
        State.SUCCEEDED,
        True,
        fresh.operation_id,
    )
    assert trips[0] <= 2, proxy.messages  # the claim + event; the outcome + event + NOTIFY
    assert trips[1] <= 1, proxy.messages
    store = Store.from_url(postgres_url)
    try:
        events = store.events("shop", fresh.operation_id)
    finally:
        store.close()
    assert [e.kind for e in events] == ["claimed", "provider_answer"]
    assert len(sandbox.ledger()) == 9  # eight warm keys and one fresh: one effect each


def test_payorch_engines_do_not_pre_ping(postgres_url: str) -> None:
    store = Store.from_url(postgres_url)
    try:
        assert store.engine.pool._pre_ping is False
    finally:
        store.close()


def test_a_pooled_connection_the_server_closed_is_replaced_not_uncertain(
    counted_store: Store,
    postgres_url: str,
    sandbox: SandboxServer,
    sandbox_provider: SandboxProvider,
) -> None:
    ex = executor_for(counted_store, sandbox_provider)
    pay(ex, "before")
    pooled = counted_store.engine.raw_connection()  # the pool's one connection, idle
    pid = pooled.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
    fd = pooled.dbapi_connection.pgconn.socket  # type: ignore[union-attr]
    pooled.close()  # back to the pool

    admin = sa.create_engine(postgres_url)
    try:
        with admin.connect() as conn:
            assert conn.execute(
                sa.text("SELECT pg_terminate_backend(:p, 5000)"), {"p": pid}
            ).scalar()
    finally:
        admin.dispose()
    # Bounded: until the server's hang-up has reached our end of the idle connection.
    readable, _, _ = select.select([fd], [], [], 10)
    assert readable

    # Not uncertain, not an error: the pool is handed a fresh connection before sending.
    out = pay(ex, "after")
    assert (out.state, out.replayed) == (State.SUCCEEDED, False)
    assert len(sandbox.ledger()) == 2


@pytest.mark.parametrize("executors", ["one", "each"])
def test_a_storm_of_waiting_duplicates_makes_one_effect_and_few_statements(
    postgres_url: str,
    sandbox: SandboxServer,
    monkeypatch: pytest.MonkeyPatch,
    executors: str,
) -> None:
    # "one": every request through one executor, as in one process: the first leads, the
    # others join its flight and touch the database only to count their replays. "each": an
    # executor per request, as across processes: the losers wait on the store's listener,
    # which reads the operation once for all of them when its NOTIFY comes.
    # Waiters then re-read only when woken by the NOTIFY (or a listener reconnect), never on
    # the safety timer within this test: their statement count is exact.
    monkeypatch.setattr(waiting, "_POLL_CAP", 600.0)
    statements = Statements()
    store = recorded_store(postgres_url, statements)
    listener = store.listener()
    assert listener is not None
    assert listener.start(timeout=30)  # listening before the first waiter looks
    duplicates = 100
    # The winner's answer is held until every loser waits: its read must outlast that.
    patient = httpx.Timeout(connect=1.0, read=60.0, write=1.0, pool=1.0)
    with (
        SandboxProvider(base_url=sandbox.url, timeout=patient) as provider,
        statements as seen,
        sandbox.hold_commits() as gate,
        ThreadPoolExecutor(duplicates) as pool,
    ):
        shared = executor_for(store, provider, lease=timedelta(minutes=5))
        wait = timedelta(seconds=120)

        def one() -> tuple[int, Outcome]:
            ex = (
                shared
                if executors == "one"
                else executor_for(store, provider, timedelta(minutes=5))
            )
            return threading.get_ident(), pay(ex, "storm", wait=wait)

        futures = [pool.submit(one) for _ in range(duplicates)]
        assert gate.wait_held(1, timeout=60)  # the winner is at the provider, held there
        # Every loser waits (one that failed instead says why).
        if executors == "one":
            everyone = shared.flights.wait_for_joiners(duplicates - 1, timeout=60)
        else:
            everyone = listener.wait_for_waiters(duplicates - 1, timeout=60)
        assert everyone, [f.exception() for f in futures if f.done()]
        gate.release()
        results = [f.result(timeout=120) for f in futures]

    try:
        winners = [(t, o) for t, o in results if not o.replayed]
        assert len(winners) == 1
        winner_thread, won = winners[0]
        assert won.state is State.SUCCEEDED
        losers = [(t, o) for t, o in results if o.replayed]
        assert len(losers) == duplicates - 1
        assert {(o.operation_id, o.state, o.provider_reference) for _, o in losers} == {
            (won.operation_id, won.state, won.provider_reference)
        }
        assert len(sandbox.ledger()) == 1

        # The winner: its claim and its outcome. A joiner: at most the one count of every
        # joiner's replay. A listener's waiter: its claim, perhaps a look once registered (if
        # the listener cannot vouch for the time since), a look if the listener reconnected.
        assert len(seen.by(winner_thread)) == 2, seen.by(winner_thread)
        per_loser = {t: len(seen.by(t)) for t, _ in losers}
        assert max(per_loser.values()) <= (1 if executors == "one" else 3), per_loser
        # Each loser's answer is one counted replay.
        with store.engine.connect() as conn:
            replays = conn.execute(
                sa.select(operations.c.replays).where(operations.c.id == won.operation_id)
            ).scalar_one()
        assert replays == duplicates - 1
    finally:
        store.close()
