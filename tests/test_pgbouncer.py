"""payorch behind a real PgBouncer in transaction pooling mode (``pooler="transaction"``).

Execute, replay, a wait on an operation in progress and the reconciler all go through the
pooler, sync and async; effects are counted at the sandbox. The pooler hands consecutive
transactions to different server connections (tests/pgbouncer.py), so anything kept in a
session (a prepared statement, a search_path, a LISTEN) would fail here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from conftest import LoopThread, create_pg_database, make_due
from pgbouncer import PgBouncer, start_or_skip
from psycopg.conninfo import conninfo_to_dict

from payorch import migrate
from payorch.core import State, downstream_key, namespace_ref
from payorch.errors import ConfigurationError, OperationInProgress
from payorch.execution._async import AsyncExecutor
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.outcome import Outcome
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.providers.sandbox._api import CommitGate
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.storage import _waiting as waiting
from payorch.storage._async_store import AsyncStore
from payorch.storage._engine import create_engine
from payorch.storage._pooling import listen_dsn
from payorch.storage._store import Store
from payorch.storage._tables import operations

pytestmark = pytest.mark.postgres

PAYMENT = {"amount": 4200, "currency": "EUR", "customer": "cus_pooled"}
MONEY = ("succeeded", "processing")
# The held request's answer must outlast the hold.
PATIENT = httpx.Timeout(connect=1.0, read=60.0, write=1.0, pool=1.0)
LEASE = timedelta(minutes=5)  # covers the patient provider's worst case
# psycopg prepares a statement after it ran this many times on one connection.
PREPARE_THRESHOLD = 5


@pytest.fixture(scope="session")
def pgbouncer(pg_server_url: str) -> Iterator[PgBouncer]:
    yield from start_or_skip(pg_server_url)


@pytest.fixture
def pooled_url(pgbouncer: PgBouncer, postgres_url: str) -> str:
    pgbouncer.warm(postgres_url)
    return pgbouncer.url(postgres_url)


@pytest.fixture
def pooled_store(pooled_url: str) -> Iterator[Store]:
    store = Store.from_url(pooled_url, pooler="transaction")
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def patient_provider(sandbox: SandboxServer) -> Iterator[SandboxProvider]:
    with SandboxProvider(base_url=sandbox.url, timeout=PATIENT) as provider:
        yield provider


Pay = Callable[..., Outcome]


def executor(store: Store, provider: SandboxProvider, owner: str) -> Executor:
    return Executor(
        store=store,
        providers=[provider],
        registry=default_registry("sandbox"),
        lease=LEASE,
        owner=owner,
    )


def payer(ex: Executor) -> Pay:
    return lambda key, wait=None: ex.execute(**_call(key, wait))


@pytest.fixture(params=["sync", "async"])
def payers(
    request: pytest.FixtureRequest,
    pooled_url: str,
    pooled_store: Store,
    sandbox: SandboxServer,
) -> Iterator[Callable[[str], Pay]]:
    """``payers(owner)``: a fresh executor (its own flights) behind the pooler, as
    ``pay(key, wait=None)``; sync or async."""
    providers: list[SandboxProvider] = []
    stores: list[AsyncStore] = []
    loop: LoopThread | None = (
        request.getfixturevalue("loop_thread") if request.param == "async" else None
    )

    def make(owner: str) -> Pay:
        provider = SandboxProvider(base_url=sandbox.url, timeout=PATIENT)
        providers.append(provider)
        if loop is None:
            return payer(executor(pooled_store, provider, owner))
        astore = AsyncStore.from_url(pooled_url, pooler="transaction")
        stores.append(astore)
        aex = AsyncExecutor(
            store=astore,
            providers=[provider],
            registry=default_registry("sandbox"),
            lease=LEASE,
            owner=owner,
        )
        return lambda key, wait=None: loop.run(aex.execute(**_call(key, wait)))

    try:
        yield make
    finally:
        for provider in providers:
            if loop is not None:
                loop.run(provider.aclose())
            provider.close()
        for astore in stores:
            assert loop is not None
            loop.run(astore.close())


def _call(key: str, wait: float | None) -> dict[str, Any]:
    return {
        "tenant_id": "shop",
        "operation": "payment.create",
        "idempotency_key": key,
        "request": PAYMENT,
        "wait": timedelta(seconds=wait) if wait is not None else None,
    }


def effects(sandbox: SandboxServer, key: str) -> int:
    """Money effects at the sandbox under the downstream key of ``shop``'s payment ``key``."""
    sent = downstream_key(namespace_ref("shop", "payment.create", key))
    return len([e for e in sandbox.effects_for(sent) if e["status"] in MONEY])


def replays(store: Store, operation_id: str) -> int:
    with store.engine.connect() as conn:
        q = sa.select(operations.c.replays).where(operations.c.id == operation_id)
        return int(conn.execute(q).scalar_one())


@pytest.fixture
def polling(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once a waiter, having read the operation in progress, naps before its next look."""
    napping = threading.Event()
    nap = waiting.pause

    def spy(seconds: float) -> None:
        napping.set()
        nap(seconds)

    monkeypatch.setattr(waiting, "pause", spy)
    return napping


def test_execute_and_replays_make_one_effect_through_the_pooler(
    payers: Callable[[str], Pay], pooled_store: Store, sandbox: SandboxServer
) -> None:
    pay = payers("pooled")
    first = pay("order-1")
    assert (first.state, first.replayed) == (State.SUCCEEDED, False)
    # More replays than psycopg needs to prepare the claim's statement: a prepared
    # statement would be missing on the next server connection the pooler hands out.
    for _ in range(PREPARE_THRESHOLD * 2):
        again = pay("order-1")
        assert (again.operation_id, again.state, again.replayed) == (
            first.operation_id,
            State.SUCCEEDED,
            True,
        )
        assert again.provider_reference == first.provider_reference
    assert effects(sandbox, "order-1") == 1
    assert len(sandbox.ledger()) == 1
    assert replays(pooled_store, first.operation_id) == PREPARE_THRESHOLD * 2


def test_the_engine_never_prepares_behind_a_transaction_pooler(pooled_store: Store) -> None:
    raw = pooled_store.engine.raw_connection()
    try:
        assert raw.driver_connection.prepare_threshold is None  # type: ignore[union-attr]
    finally:
        raw.close()
    # Without a direct URL to listen on, waiters poll: no LISTEN through the pooler.
    assert pooled_store.listener() is None


Held = tuple[ThreadPoolExecutor, CommitGate]


@pytest.fixture
def held(sandbox: SandboxServer) -> Iterator[Held]:
    """A pool to send from, and the gate holding requests at the sandbox."""
    with sandbox.hold_commits() as gate, ThreadPoolExecutor(4) as pool:
        yield pool, gate


def _first_at_the_provider(held: Held, pay: Pay, key: str) -> Future[Outcome]:
    """The first request for ``key``, held at the provider (its operation in progress)."""
    pool, gate = held
    first = pool.submit(pay, key, 60)
    assert gate.wait_held(1, timeout=30)
    return first


def test_a_waiter_polls_through_the_pooler_and_gets_the_outcome(
    payers: Callable[[str], Pay],
    sandbox: SandboxServer,
    held: Held,
    polling: threading.Event,
) -> None:
    pool, gate = held
    first = _first_at_the_provider(held, payers("first"), "order-2")
    waiter = pool.submit(payers("second"), "order-2", 60)
    assert polling.wait(30)  # it read the operation in progress and waits for it
    gate.release()
    won, waited = first.result(timeout=60), waiter.result(timeout=60)
    assert (won.state, won.replayed) == (State.SUCCEEDED, False)
    assert (waited.operation_id, waited.state, waited.replayed) == (
        won.operation_id,
        State.SUCCEEDED,
        True,
    )
    assert effects(sandbox, "order-2") == 1


def test_a_wait_that_ends_first_is_in_progress_through_the_pooler(
    payers: Callable[[str], Pay],
    sandbox: SandboxServer,
    held: Held,
) -> None:
    _pool, gate = held
    first = _first_at_the_provider(held, payers("first"), "order-3")
    with pytest.raises(OperationInProgress) as caught:
        payers("second")("order-3", 0.3)
    assert caught.value.retry_after is not None
    gate.release()
    won = first.result(timeout=60)
    assert won.state is State.SUCCEEDED and caught.value.operation_id == won.operation_id
    assert effects(sandbox, "order-3") == 1


def test_waiters_listen_on_the_direct_url_behind_the_pooler(
    pooled_url: str,
    postgres_url: str,
    sandbox: SandboxServer,
    patient_provider: SandboxProvider,
    held: Held,
) -> None:
    pool, gate = held
    store = Store.from_url(pooled_url, pooler="transaction", listen_url=postgres_url)
    try:
        listener = store.listener()
        assert listener is not None and listener.start(timeout=30)
        first = _first_at_the_provider(
            held, payer(executor(store, patient_provider, "a")), "order-4"
        )
        waiter = pool.submit(payer(executor(store, patient_provider, "b")), "order-4", 60)
        assert listener.wait_for_waiters(1, timeout=30)
        gate.release()
        won, waited = first.result(timeout=60), waiter.result(timeout=60)
    finally:
        store.close()
    assert (waited.operation_id, waited.state, waited.replayed) == (
        won.operation_id,
        State.SUCCEEDED,
        True,
    )
    assert effects(sandbox, "order-4") == 1


def test_the_reconciler_settles_an_unknown_operation_through_the_pooler(
    pooled_store: Store, sandbox: SandboxServer, patient_provider: SandboxProvider
) -> None:
    ex = executor(pooled_store, patient_provider, "pooled")
    sandbox.inject("drop_after")  # the charge commits at the sandbox; its answer is lost
    first = ex.execute(**_call("order-5", None))
    assert first.state is State.OUTCOME_UNKNOWN
    make_due(pooled_store, first.operation_id)
    reconciler = Reconciler(
        store=pooled_store,
        providers=[patient_provider],
        policy=ReconcilerPolicy(lease=LEASE),
        owner="pooled-reconciler",
    )
    report = reconciler.reconcile_once()
    assert report.outcomes["succeeded"] == 1
    settled = pooled_store.get("shop", first.operation_id)
    assert settled.state is State.SUCCEEDED and settled.resolution == "status_query"
    again = ex.execute(**_call("order-5", None))
    assert (again.operation_id, again.state, again.replayed) == (
        first.operation_id,
        State.SUCCEEDED,
        True,
    )
    assert effects(sandbox, "order-5") == 1


# -- a schema of its own behind the pooler -----------------------------------------------

SCHEMA = "payorch_pooled"


def _database_with_search_path(pg_server_url: str, search_path: str | None) -> str:
    url = create_pg_database(pg_server_url, prefix="payorch_pooled")
    if search_path is not None:
        admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                name = sa.make_url(url).database
                conn.exec_driver_sql(f'ALTER DATABASE "{name}" SET search_path = {search_path}')
        finally:
            admin.dispose()
    return url


def test_a_schema_set_by_the_server_works_behind_the_pooler(
    pg_server_url: str,
    pgbouncer: PgBouncer,
    monkeypatch: pytest.MonkeyPatch,
    sandbox: SandboxServer,
    patient_provider: SandboxProvider,
) -> None:
    url = pgbouncer.url(_database_with_search_path(pg_server_url, SCHEMA))
    monkeypatch.setenv("PAYORCH_DB_SCHEMA", SCHEMA)
    monkeypatch.setenv("PAYORCH_DATABASE_POOLER", "transaction")
    migrate.upgrade(url)  # through the pooler too
    store = Store.from_url(url)
    try:
        ex = executor(store, patient_provider, "pooled")
        first = ex.execute(**_call("order-6", None))
        again = ex.execute(**_call("order-6", None))
        with store.engine.connect() as conn:
            where = conn.exec_driver_sql(
                "SELECT table_schema FROM information_schema.tables WHERE table_name = %s",
                ("payorch_operations",),
            ).scalars()
            schemas = set(where)
    finally:
        store.close()
    assert first.state is State.SUCCEEDED and again.replayed
    assert effects(sandbox, "order-6") == 1
    assert schemas == {SCHEMA}


def test_a_schema_the_server_does_not_set_is_refused_behind_the_pooler(
    pg_server_url: str, pgbouncer: PgBouncer
) -> None:
    url = pgbouncer.url(_database_with_search_path(pg_server_url, None))
    engine = create_engine(url, schema=SCHEMA, pooler="transaction")
    try:
        with pytest.raises(ConfigurationError, match="search_path"), engine.connect():
            pass
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("pooler", "problem"), [("statement", "statement pooling"), ("pgpool", "use one of")]
)
def test_a_pooler_payorch_cannot_run_behind_is_refused(pooler: str, problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem):
        create_engine("postgresql://u@127.0.0.1:6432/db", pooler=pooler)


def test_the_environment_names_the_pooler_and_where_to_listen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PAYORCH_DATABASE_POOLER", "transaction")
    monkeypatch.setenv("PAYORCH_LISTEN_DATABASE_URL", "postgresql://app@db-primary:5432/pay")
    pooled = create_engine("postgresql://app@pgbouncer:6432/pay")
    # A libpq conninfo (a multi-host URL has no libpq URL form): the server itself.
    server = {"host": "db-primary", "port": "5432", "dbname": "pay", "user": "app"}
    dsn = listen_dsn(pooled)
    assert dsn is not None and conninfo_to_dict(dsn) == server
    monkeypatch.delenv("PAYORCH_LISTEN_DATABASE_URL")
    assert listen_dsn(create_engine("postgresql://app@pgbouncer:6432/pay")) is None
    monkeypatch.setenv("PAYORCH_LISTEN_DATABASE_URL", "sqlite:///payorch.db")
    with pytest.raises(ConfigurationError, match="PostgreSQL URL"):
        create_engine("postgresql://app@pgbouncer:6432/pay")
    monkeypatch.delenv("PAYORCH_DATABASE_POOLER")
    monkeypatch.delenv("PAYORCH_LISTEN_DATABASE_URL")
    direct = create_engine("postgresql://app@db-primary:5432/pay")
    dsn = listen_dsn(direct)
    assert dsn is not None and conninfo_to_dict(dsn) == server
