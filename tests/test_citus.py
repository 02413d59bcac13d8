"""payorch on Citus, its tables distributed by tenant (a coordinator and two workers on
loopback): the scenarios that failed before, counted at the provider, and the distribution
command and start-up check. The whole storage, execution, reconciler, outbox and CLI suites
run here too, through the ``citus`` parameter of ``db_url`` (tests/conftest.py). Without
Citus these skip with one loud line."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from citus import exclusive
from conftest import FAST_TIMEOUT, _truncate, make_due

from payorch import migrate
from payorch.core import State
from payorch.errors import ConfigurationError, IdempotencyKeyReused, SchemaNotReady
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.records import NewOperation
from payorch.storage._distribution import DISTRIBUTED_TABLES, read_placement
from payorch.storage._store import Store
from payorch.storage._waiting import NOTIFY_CHANNEL

PAYORCH = Path(sys.executable).parent / "payorch"
PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}
MONEY = ("succeeded", "processing")
# Citus refuses, for this session, a statement of several tasks or with intermediate results.
ROUTER_ONLY = "-c citus.multi_task_query_log_level=error -c citus.max_intermediate_result_size=0"


@pytest.fixture
def citus(citus_url: str) -> Iterator[str]:
    with exclusive(citus_url):
        _truncate(citus_url)
        yield citus_url


@pytest.fixture
def store(citus: str) -> Iterator[Store]:
    s = Store.from_url(citus)
    try:
        yield s
    finally:
        s.close()


def executor(store: Store, provider: SandboxProvider) -> Executor:
    return Executor(
        store=store,
        providers=[provider],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
        owner="citus-test",
    )


def money(sandbox: SandboxServer, store: Store, tenant: str, op_id: str) -> int:
    key = store.get(tenant, op_id).downstream_key
    return len([e for e in sandbox.effects_for(key) if e["status"] in MONEY])


def run(*args: str, url: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
    return subprocess.run(
        [str(PAYORCH), *args, "--database-url", url],
        capture_output=True,
        text=True,
        env={**clean, **env},
        timeout=120,
        check=False,
    )


def test_the_schema_is_distributed_by_tenant_and_co_located(store: Store) -> None:
    placement = read_placement(store.engine)
    assert placement.citus is not None and placement.distributed and placement.workers >= 2
    tables = {name: placement.tables[name] for name in DISTRIBUTED_TABLES}
    assert {t.kind for t in tables.values()} == {"distributed"}
    assert {t.column for t in tables.values()} == {"tenant_id"}
    assert len({t.colocation for t in tables.values()}) == 1
    assert placement.tables["payorch_alembic_version"].kind == "reference"
    assert store.check_schema() == migrate.head_revision()


def test_fresh_payments_of_thirty_tenants_each_charge_once(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    ex = executor(store, sandbox_provider)
    outcomes = [
        ex.execute(
            tenant_id=f"tenant-{n:02d}",
            operation="payment.create",
            idempotency_key="order-1",
            request=PAYMENT,
        )
        for n in range(30)
    ]
    assert {o.state for o in outcomes} == {State.SUCCEEDED}
    assert len(sandbox.ledger()) == 30
    for n, outcome in enumerate(outcomes):
        assert money(sandbox, store, f"tenant-{n:02d}", outcome.operation_id) == 1
        assert [e.kind for e in store.events(f"tenant-{n:02d}", outcome.operation_id)] == [
            "claimed",
            "provider_answer",
        ]


def test_sixteen_racing_duplicates_of_one_key_make_one_effect(
    citus: str, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    """The claim, the waits and their rereads: single-shard statements throughout."""
    router_only = Store.from_url(citus, connect_args={"options": ROUTER_ONLY})
    ex = executor(router_only, sandbox_provider)
    start = threading.Barrier(16)
    answers: list[object] = []

    def one() -> None:
        start.wait()
        try:
            answers.append(
                ex.execute(
                    tenant_id="race",
                    operation="payment.create",
                    idempotency_key="the-key",
                    request=PAYMENT,
                    wait=timedelta(seconds=20),
                )
            )
        except Exception as exc:
            answers.append(exc)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    router_only.close()
    assert len(answers) == 16
    ids = {a.operation_id for a in answers if hasattr(a, "operation_id")}
    assert len(ids) == 1
    assert all(getattr(a, "state", State.SUCCEEDED) is State.SUCCEEDED for a in answers)
    assert len(sandbox.ledger()) == 1 and money(sandbox, store, "race", ids.pop()) == 1


def test_a_waiter_hears_the_outcome_from_the_coordinator(store: Store, citus: str) -> None:
    """The waiters' NOTIFY is sent where they listen (a worker's would reach nobody)."""
    dsn = sa.make_url(citus).set(drivername="postgresql").render_as_string(hide_password=False)
    new = NewOperation(
        tenant_id="heard",
        operation="payment.create",
        idempotency_key="k",
        fingerprint="f",
        provider="sandbox",
    )
    with psycopg.connect(dsn, autocommit=True) as listen:
        listen.execute(f"LISTEN {NOTIFY_CHANNEL}")
        op = store.claim(new, owner="holder", lease=timedelta(seconds=30)).operation
        assert store.flag_waiting(op) is not None  # as a waiter does, once it listens
        store.transition(op, State.SUCCEEDED, kind="provider_answer", actor="holder")
        heard = [n.payload for n in listen.notifies(timeout=10, stop_after=1)]
    assert heard == [f"heard:{op.id}"]


def test_the_reconciler_settles_unknowns_of_many_tenants(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    ex = executor(store, sandbox_provider)
    unknown = {}
    for n in range(6):
        sandbox.inject("drop_after")
        outcome = ex.execute(
            tenant_id=f"t{n}", operation="payment.create", idempotency_key="k", request=PAYMENT
        )
        assert outcome.state is State.OUTCOME_UNKNOWN
        unknown[f"t{n}"] = outcome.operation_id
        make_due(store, outcome.operation_id)
    rec = Reconciler(
        store=store,
        providers=[sandbox_provider],
        policy=ReconcilerPolicy(lease=timedelta(seconds=30), batch_size=4),
        owner="citus-reconciler",
    )
    first, second = rec.reconcile_once(), rec.reconcile_once()
    assert first.outcomes == Counter({"succeeded": 4})
    assert second.outcomes == Counter({"succeeded": 2})
    for tenant, op_id in unknown.items():
        record = store.get(tenant, op_id)
        assert (record.state, record.resolution) == (State.SUCCEEDED, "status_query")
        assert money(sandbox, store, tenant, op_id) == 1
    assert len(sandbox.ledger()) == 6


def test_reconcile_once_from_the_cli(store: Store, citus: str, sandbox: SandboxServer) -> None:
    with SandboxProvider(base_url=sandbox.url, timeout=FAST_TIMEOUT) as provider:
        sandbox.inject("drop_after")
        outcome = executor(store, provider).execute(
            tenant_id="cli", operation="payment.create", idempotency_key="k", request=PAYMENT
        )
    assert outcome.state is State.OUTCOME_UNKNOWN
    make_due(store, outcome.operation_id)
    done = run("reconcile", "once", url=citus, PAYORCH_SANDBOX_URL=sandbox.url)
    assert done.returncode == 0, done.stderr
    assert store.get("cli", outcome.operation_id).state is State.SUCCEEDED
    assert len(sandbox.ledger()) == 1


def test_distribute_again_changes_nothing_and_health_shows_the_placement(citus: str) -> None:
    again = run("db", "distribute", url=citus)
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stdout
    health = run("db", "health", url=citus)
    assert health.returncode == 0, health.stderr
    assert "Citus" in health.stdout and "distributed by tenant_id" in health.stdout


@pytest.fixture
def schema(citus_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A schema of its own on the cluster (PAYORCH_DB_SCHEMA), dropped after."""
    name = f"s_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("PAYORCH_DB_SCHEMA", name)
    try:
        yield name
    finally:
        engine = sa.create_engine(citus_url)
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {name} CASCADE")
        engine.dispose()


def test_migrations_after_distribution_keep_the_schema_distributed(
    citus_url: str, schema: str
) -> None:
    migrate.upgrade(citus_url, "payorch_0002")
    assert migrate.distribute(citus_url)  # the tables of 0002 only
    migrate.upgrade(citus_url)  # 0003 indexes a distributed table, 0004 creates tables
    store = Store.from_url(citus_url)
    try:
        placement = read_placement(store.engine)
        assert {placement.tables[t].kind for t in DISTRIBUTED_TABLES} == {"distributed"}
        assert store.check_schema() == migrate.head_revision()
    finally:
        store.close()
    assert migrate.distribute(citus_url) == []


def test_a_partly_distributed_schema_is_refused_at_start_up(citus_url: str, schema: str) -> None:
    migrate.upgrade(citus_url)
    engine = sa.create_engine(citus_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"SET search_path TO {schema}")
        conn.exec_driver_sql("SELECT create_distributed_table('payorch_operations', 'tenant_id')")
    engine.dispose()
    store = Store.from_url(citus_url)
    try:
        with pytest.raises(SchemaNotReady, match=r"partly distributed.*payorch db distribute"):
            store.check_schema()
    finally:
        store.close()


def test_distribute_without_citus_is_one_line_and_changes_nothing(postgres_url: str) -> None:
    done = run("db", "distribute", url=postgres_url)
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "Citus" in done.stderr
    assert "Traceback" not in done.stderr
    with pytest.raises(ConfigurationError, match="nothing changed"):
        migrate.distribute(postgres_url)
    engine = sa.create_engine(postgres_url)
    try:
        assert read_placement(engine).citus is None
    finally:
        engine.dispose()


def test_the_request_path_reaches_one_shard_per_statement(
    citus: str, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    """With Citus told to refuse any statement that runs on more than one shard or passes
    rows between its parts through the coordinator (a recursively planned CTE), payments,
    their replays, a decline, a refused reuse and the waiters' reads all still work."""
    router_only = Store.from_url(citus, connect_args={"options": ROUTER_ONLY})
    try:
        ex = executor(router_only, sandbox_provider)
        paid = ex.execute(
            tenant_id="one", operation="payment.create", idempotency_key="a", request=PAYMENT
        )
        again = ex.execute(
            tenant_id="one", operation="payment.create", idempotency_key="a", request=PAYMENT
        )
        sandbox.inject("decline")
        declined = ex.execute(
            tenant_id="one", operation="payment.create", idempotency_key="b", request=PAYMENT
        )
        with pytest.raises(IdempotencyKeyReused):
            ex.execute(
                tenant_id="one",
                operation="payment.create",
                idempotency_key="a",
                request={**PAYMENT, "amount": 9},
            )
        assert (paid.state, again.replayed, again.operation_id) == (
            State.SUCCEEDED,
            True,
            paid.operation_id,
        )
        assert declined.state is State.FAILED_FINAL
        assert router_only.events("one", paid.operation_id)[0].kind == "claimed"
    finally:
        router_only.close()
    assert len([e for e in sandbox.ledger() if e["status"] in MONEY]) == 1


def test_the_relay_leases_shard_by_shard_in_order(citus: str) -> None:
    """The relay's read fans out; every lease is a single-shard statement (Citus told to
    refuse intermediate results): one aggregate's messages arrive in order through a
    failure, each tenant's, and a message past its attempts is dead-lettered."""
    from test_outbox import NOW, Ledger, _stage, settle

    from payorch.outbox import Message, Relay, RelayPolicy

    store = Store.from_url(
        citus, connect_args={"options": "-c citus.max_intermediate_result_size=0"}
    )
    try:
        staged = {
            tenant: _stage(
                store,
                *(Message("step", "order", "o-1", {"n": n}) for n in range(3)),
                tenant_id=tenant,
            )
            for tenant in ("a", "b", "c")
        }
        sink = Ledger(fail=2)
        with Relay(store, {"default": sink}, policy=NOW, rand=lambda: 0.0) as relay:
            total = settle(relay)
        assert total.delivered == 9 and total.failed == 2 and total.dead == 0
        for tenant, ids in staged.items():
            assert [m.id for m in sink.got if m.tenant_id == tenant] == ids
        (doomed,) = _stage(store, Message("t", "order", "o-9", {}), tenant_id="a")
        dying = Ledger(fail=100)
        policy = RelayPolicy(max_attempts=2, backoff_base=1.0, concurrency=1)
        with Relay(store, {"default": dying}, policy=policy, rand=lambda: 0.0) as relay:
            settle(relay)
        assert dying.got == [] and dying.fail == 98
        with store.engine.connect() as conn:
            state = conn.exec_driver_sql(
                "SELECT state FROM payorch_outbox WHERE tenant_id = 'a' AND id = %(id)s",
                {"id": doomed},
            ).scalar_one()
        assert state == "dead"
    finally:
        store.close()


def test_daemons_lease_disjoint_batches_oldest_first_and_by_tenant(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    ex = executor(store, sandbox_provider)
    due: dict[str, str] = {}
    for n in range(12):
        sandbox.inject("drop_after")
        outcome = ex.execute(
            tenant_id=f"d{n % 6}",
            operation="payment.create",
            idempotency_key=f"k{n}",
            request=PAYMENT,
        )
        due[outcome.operation_id] = f"d{n % 6}"
        make_due(store, outcome.operation_id)
    lease = timedelta(seconds=60)
    only = store.claim_due(owner="tenant-daemon", lease=lease, limit=10, tenant_ids={"d3"})
    assert sorted(r.tenant_id for r, _ in only) == ["d3", "d3"]
    first = store.claim_due(owner="daemon-1", lease=lease, limit=5)
    second = store.claim_due(owner="daemon-2", lease=lease, limit=5)
    rest = store.claim_due(owner="daemon-3", lease=lease, limit=5)
    batches = [{r.id for r, _ in batch} for batch in (only, first, second, rest)]
    assert [len(b) for b in batches] == [2, 5, 5, 0]
    assert set().union(*batches) == set(due) and sum(map(len, batches)) == len(due)
    for batch, owner in zip(batches[1:3], ("daemon-1", "daemon-2"), strict=True):
        assert {store.get(due[i], i).lease_owner for i in batch} == {owner}
    assert len(sandbox.ledger()) == 12
