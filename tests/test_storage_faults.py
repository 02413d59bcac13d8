"""A storage failure is never "nothing happened": lost COMMIT answers and outcomes not recorded.

PostgreSQL is reached through a loopback TCP proxy that can forward a statement that commits
(the claim and the outcome are single statements in autocommit, each its own COMMIT), wait
for the server's answer (the commit is then durable), drop that answer and cut the
connection, or refuse every connection (the database "goes down"). SQLite and PostgreSQL
alike also get a statement-level fault from a trigger while the provider's answer is being
recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import FAST_TIMEOUT, RecordingSleep, age, make_due
from pgproxy import LoopbackProxy
from sqlalchemy.engine import Connection

from payorch.core import State
from payorch.errors import (
    CommitUncertain,
    OperationInProgress,
    OutcomeNotRecorded,
    StorageError,
)
from payorch.execution._executor import Executor
from payorch.http import http_answer
from payorch.operations import default_registry
from payorch.outcome import Outcome
from payorch.provider import Answer, SubmitRequest
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.storage._engine import run_in_transaction
from payorch.storage._store import Store

PAYMENT = {"amount": 1500, "currency": "EUR", "customer": "cus_9"}


class PgProxy(LoopbackProxy):
    """Forwards bytes between clients and PostgreSQL on 127.0.0.1; faults on demand."""

    def __init__(self, host: str, port: int) -> None:
        self._drop_commit_ack = False
        self._down = False
        self.commit_acks_dropped = 0
        super().__init__(host, port)

    def drop_next_commit_ack(self) -> None:
        """The next statement (a COMMIT, or a write in autocommit: its own commit) reaches
        the server; its answer never reaches the client."""
        with self._lock:
            self._drop_commit_ack = True

    def go_down(self) -> None:
        """Cut every connection and refuse new ones, as a dead server would."""
        with self._lock:
            self._down = True
        self.cut_all()

    def heal(self) -> None:
        with self._lock:
            self._down = False

    def refusing(self) -> bool:
        with self._lock:
            return self._down

    def on_client(self, flow: dict[str, Any], data: bytes) -> None:
        with self._lock:
            if self._drop_commit_ack and _ends_statement(data):
                self._drop_commit_ack = False
                flow["awaiting_ack"] = True

    def on_server(self, flow: dict[str, Any], data: bytes) -> bool:
        if not flow.get("awaiting_ack"):
            return True
        # The server answered the COMMIT: it is durable. Drop the answer, cut.
        with self._lock:
            self.commit_acks_dropped += 1
        return False


def _ends_statement(data: bytes) -> bool:
    """Whether client bytes may commit: a COMMIT, or an extended-protocol batch closed by
    Sync (where a statement in autocommit commits)."""
    return b"COMMIT\x00" in data or data.endswith(b"S\x00\x00\x00\x04")


@pytest.fixture
def pg_proxy(postgres_url: str) -> Iterator[PgProxy]:
    url = sa.make_url(postgres_url)
    proxy = PgProxy(url.host or "127.0.0.1", url.port or 5432)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def proxied_store(pg_proxy: PgProxy, postgres_url: str) -> Iterator[Store]:
    store = Store.from_url(pg_proxy.url(postgres_url), pool_size=2, max_overflow=0)
    try:
        yield store
    finally:
        store.close()


def executor_for(store: Store, provider: SandboxProvider) -> Executor:
    return Executor(
        store=store,
        providers=[provider],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
        sleep=RecordingSleep(),
        owner="test-executor",
    )


def pay(executor: Executor, key: str) -> Outcome:
    return executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key=key, request=PAYMENT
    )


def reconcile(store: Store, provider: SandboxProvider) -> None:
    policy = ReconcilerPolicy(lease=timedelta(seconds=30))
    Reconciler(store=store, providers=[provider], policy=policy, owner="test-rec").reconcile_once()


def assert_same_key_answer(err: OutcomeNotRecorded) -> None:
    answer = http_answer(err)
    assert answer.status == 503
    assert int(answer.headers["Retry-After"]) >= 1
    assert answer.body["retry"] == "same_key"
    assert answer.body["type"] == err.problem_type
    assert answer.headers["Payorch-Operation-Id"] == err.operation_id
    assert "new key" not in answer.body["detail"].replace("never with a new one", "")


def test_a_lost_commit_answer_on_the_claim_is_never_nothing_happened(
    pg_proxy: PgProxy,
    proxied_store: Store,
    postgres_url: str,
    sandbox: SandboxServer,
    sandbox_provider: SandboxProvider,
) -> None:
    ex = executor_for(proxied_store, sandbox_provider)
    proxied_store.db_time()  # a pooled connection, past its start-up, before the fault
    pg_proxy.drop_next_commit_ack()
    with pytest.raises(CommitUncertain) as info:
        pay(ex, "lost-ack")
    assert pg_proxy.commit_acks_dropped == 1
    assert_same_key_answer(info.value)

    # The claim did commit: the operation exists, marked possibly sent, nothing sent yet.
    direct = Store.from_url(postgres_url)
    try:
        stored = direct.get_by_namespace("shop", "payment.create", "lost-ack")
        assert stored.id == info.value.operation_id
        assert (stored.state, stored.possibly_sent) == (State.IN_PROGRESS, True)
        assert sandbox.ledger() == []

        # The same key again (the pool reconnects through the healed proxy): the operation as
        # it stands, never a second claim.
        with pytest.raises(OperationInProgress) as busy:
            pay(ex, "lost-ack")
        assert busy.value.operation_id == stored.id

        # The reconciler finishes it with the same downstream key; the key then replays.
        make_due(direct, stored.id)
        age(direct, stored.id, timedelta(minutes=5))  # past the not-found grace
        reconcile(direct, sandbox_provider)
        again = pay(ex, "lost-ack")
        assert (again.state, again.replayed, again.operation_id) == (
            State.SUCCEEDED,
            True,
            stored.id,
        )
        assert len(sandbox.ledger()) == 1
    finally:
        direct.close()


class _AfterSubmit(SandboxProvider):
    """The provider commits; then the database fails before we record its answer."""

    def __init__(self, fault: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._fault = fault

    def submit(self, request: SubmitRequest) -> Answer:
        answer = super().submit(request)
        self._fault()
        return answer


@pytest.mark.parametrize("fault", ["down", "lost_commit_answer"])
def test_database_lost_after_the_provider_committed(
    pg_proxy: PgProxy,
    proxied_store: Store,
    postgres_url: str,
    sandbox: SandboxServer,
    fault: str,
) -> None:
    inject = pg_proxy.go_down if fault == "down" else pg_proxy.drop_next_commit_ack
    with _AfterSubmit(inject, base_url=sandbox.url, timeout=FAST_TIMEOUT) as provider:
        ex = executor_for(proxied_store, provider)
        with pytest.raises(OutcomeNotRecorded) as info:
            pay(ex, f"after-{fault}")
        assert_same_key_answer(info.value)
        assert len(sandbox.ledger()) == 1
        pg_proxy.heal()

        direct = Store.from_url(postgres_url)
        try:
            op_id = info.value.operation_id
            assert op_id is not None
            record = direct.get("shop", op_id)
            if fault == "down":  # nothing recorded: the reconciler asks the provider
                assert record.state is State.IN_PROGRESS
                make_due(direct, op_id)
                reconcile(direct, provider)
            else:  # the outcome's COMMIT landed; only its answer was lost
                assert record.state is State.SUCCEEDED
            with SandboxProvider(base_url=sandbox.url, timeout=FAST_TIMEOUT) as plain:
                again = pay(executor_for(proxied_store, plain), f"after-{fault}")
            assert (again.state, again.replayed, again.operation_id) == (
                State.SUCCEEDED,
                True,
                op_id,
            )
            assert len(sandbox.ledger()) == 1
        finally:
            direct.close()


# Citus keeps triggers off distributed tables unless told (this one only raises).
_ALLOW_TRIGGERS = (
    "SELECT set_config('citus.enable_unsafe_triggers', 'on', true) "
    "FROM pg_extension WHERE extname = 'citus'"
)


def _install_fault(store: Store) -> None:
    """Every UPDATE of an operation fails from now on (a statement-level storage fault)."""
    with store.engine.begin() as conn:
        if store.is_postgres:
            conn.exec_driver_sql(_ALLOW_TRIGGERS)
            conn.exec_driver_sql(
                "CREATE OR REPLACE FUNCTION payorch_test_fault() RETURNS trigger "
                "LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'injected storage fault'; END $$"
            )
            conn.exec_driver_sql(
                "CREATE TRIGGER payorch_test_fault BEFORE UPDATE ON payorch_operations "
                "FOR EACH ROW EXECUTE FUNCTION payorch_test_fault()"
            )
        else:
            conn.exec_driver_sql(
                "CREATE TRIGGER payorch_test_fault BEFORE UPDATE ON payorch_operations "
                "BEGIN SELECT RAISE(ABORT, 'injected storage fault'); END"
            )


def _remove_fault(store: Store) -> None:
    with store.engine.begin() as conn:
        if store.is_postgres:
            conn.exec_driver_sql(_ALLOW_TRIGGERS)
            conn.exec_driver_sql("DROP TRIGGER IF EXISTS payorch_test_fault ON payorch_operations")
        else:
            conn.exec_driver_sql("DROP TRIGGER IF EXISTS payorch_test_fault")
    if store.is_postgres:  # apart: Citus drops a function in a transaction of its own
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DROP FUNCTION IF EXISTS payorch_test_fault()")


def test_recording_the_outcome_fails_after_the_provider_committed(
    store: Store, sandbox: SandboxServer
) -> None:
    with _AfterSubmit(
        lambda: _install_fault(store), base_url=sandbox.url, timeout=FAST_TIMEOUT
    ) as provider:
        ex = executor_for(store, provider)
        try:
            with pytest.raises(OutcomeNotRecorded) as info:
                pay(ex, "unrecorded")
        finally:
            _remove_fault(store)
        assert not isinstance(info.value, CommitUncertain)  # refused before COMMIT, yet unknown
        assert_same_key_answer(info.value)
        assert len(sandbox.ledger()) == 1
        op_id = info.value.operation_id
        assert op_id is not None
        assert store.get("shop", op_id).state is State.IN_PROGRESS

        with pytest.raises(OperationInProgress):  # the lease still runs: same key, later
            pay(ex, "unrecorded")
        make_due(store, op_id)
        reconcile(store, provider)
        settled = store.get("shop", op_id)
        assert (settled.state, settled.resolution) == (State.SUCCEEDED, "status_query")
        assert len(sandbox.ledger()) == 1


def test_a_commit_the_server_refuses_is_not_uncertain(postgres_url: str) -> None:
    # A deferred constraint fails at COMMIT with a SQLSTATE: the server rolled it back.
    store = Store.from_url(postgres_url)

    def txn(conn: Connection) -> None:
        conn.exec_driver_sql(
            "CREATE TEMP TABLE payorch_test_deferred (k int UNIQUE DEFERRABLE INITIALLY DEFERRED)"
        )
        conn.exec_driver_sql("INSERT INTO payorch_test_deferred VALUES (1), (1)")

    try:
        with pytest.raises(StorageError) as info:
            run_in_transaction(store.engine, txn)
        assert not isinstance(info.value, OutcomeNotRecorded)
    finally:
        store.close()


def test_sqlite_commits_are_synced_in_full(tmp_path: Any, sqlite_template: Any) -> None:
    import shutil

    target = tmp_path / "durable.db"
    shutil.copyfile(sqlite_template, target)
    store = Store.from_url(f"sqlite:///{target}")
    try:
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar_one() == 2  # FULL
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar_one() == "wal"
    finally:
        store.close()
