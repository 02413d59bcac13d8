"""The durable store on real PostgreSQL and SQLite: claim, replay, conflicts, fencing."""

from __future__ import annotations

import multiprocessing
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import sqlalchemy as sa
import workers

from payorch import migrate
from payorch.core import State, downstream_key, namespace_ref
from payorch.errors import (
    IdempotencyKeyReused,
    InvalidTransition,
    OperationInProgress,
    StaleVersion,
)
from payorch.operations import default_registry
from payorch.records import ClaimResult, NewOperation
from payorch.storage._distribution import read_placement
from payorch.storage._store import Store
from payorch.storage._tables import events, operations

LEASE = timedelta(seconds=30)
REQUEST = {"amount": 2500, "currency": "EUR", "customer": "cus_42"}


def _new(
    key: str = "key-1", tenant: str = "t1", operation: str = "payment.create", **req: object
) -> NewOperation:
    return (
        default_registry("sandbox")
        .prepare(
            tenant_id=tenant, operation=operation, idempotency_key=key, request={**REQUEST, **req}
        )
        .new
    )


def _count(store: Store, table: sa.Table) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def test_claim_persists_in_progress_with_lease_and_downstream_key(store: Store) -> None:
    res = store.claim(_new(), owner="worker-a", lease=LEASE)
    op = res.operation
    assert res.created and not res.replayed
    assert op.state is State.IN_PROGRESS
    assert op.lease_owner == "worker-a"
    assert op.lease_expires_at is not None and op.lease_expires_at > op.created_at
    # From the namespace, never from the operation id (a failover may re-create the claim).
    new = _new()
    ref = namespace_ref(new.tenant_id, new.operation, new.idempotency_key)
    assert op.downstream_key == downstream_key(ref) and op.id not in op.downstream_key
    stored = store.get("t1", op.id)
    assert stored == op
    assert [e.kind for e in store.events("t1", op.id)] == ["claimed"]


def test_hundred_threads_one_winner_then_replay(store: Store) -> None:
    new = _new("race-key")
    barrier = threading.Barrier(100)

    def attempt(_: int) -> tuple[str, str]:
        barrier.wait()
        try:
            res = store.claim(new, owner="w", lease=LEASE)
            return ("won" if res.created else "other", res.operation.id)
        except OperationInProgress as exc:
            assert exc.retry_after >= 1
            assert exc.operation_id is not None
            return ("in_progress", exc.operation_id)

    with ThreadPoolExecutor(max_workers=100) as pool:
        results = list(pool.map(attempt, range(100)))

    outcomes = Counter(kind for kind, _ in results)
    assert outcomes["won"] == 1
    assert outcomes["in_progress"] == 99
    assert len({op_id for _, op_id in results}) == 1
    assert _count(store, operations) == 1

    (winner_id,) = {op_id for _, op_id in results}
    op = store.get("t1", winner_id)
    store.transition(
        op, State.SUCCEEDED, kind="provider_answer", actor="w", response={"id": "pi_1"}
    )

    with ThreadPoolExecutor(max_workers=20) as pool:
        later: list[ClaimResult] = list(
            pool.map(lambda _: store.claim(new, owner="x", lease=LEASE), range(20))
        )
    assert all(r.replayed and not r.created for r in later)
    assert {r.operation.id for r in later} == {winner_id}
    assert all(r.operation.response == {"id": "pi_1"} for r in later)
    assert _count(store, operations) == 1


def test_changed_effect_field_is_refused_and_changes_nothing(store: Store) -> None:
    first = store.claim(_new("k"), owner="w", lease=LEASE).operation
    n_events = _count(store, events)
    with pytest.raises(IdempotencyKeyReused) as info:
        store.claim(_new("k", amount=2501), owner="w", lease=LEASE)
    assert info.value.http_status == 422
    assert info.value.operation_id == first.id
    assert store.get("t1", first.id) == first
    assert _count(store, operations) == 1
    # The refusal is noted in the operation's log (for stats), nothing else is written.
    assert _count(store, events) == n_events + 1
    noted = store.events("t1", first.id)[-1]
    assert noted.kind == "key_reused" and noted.to_state is None


def test_transport_field_change_is_the_same_operation(store: Store) -> None:
    first = store.claim(_new("k"), owner="w", lease=LEASE).operation
    store.transition(first, State.SUCCEEDED, kind="provider_answer", actor="w")
    again = store.claim(_new("k", description="sent again"), owner="w", lease=LEASE)
    assert again.replayed and again.operation.id == first.id


def test_same_key_on_other_tenant_or_operation_is_another_operation(store: Store) -> None:
    a = store.claim(_new("shared"), owner="w", lease=LEASE)
    b = store.claim(_new("shared", tenant="t2"), owner="w", lease=LEASE)
    c = store.claim(
        default_registry("sandbox")
        .prepare(
            tenant_id="t1",
            operation="payout.create",
            idempotency_key="shared",
            request={"amount": 1, "currency": "EUR", "destination": "ba_1"},
        )
        .new,
        owner="w",
        lease=LEASE,
    )
    assert a.created and b.created and c.created
    assert len({a.operation.id, b.operation.id, c.operation.id}) == 3


def test_outcome_unknown_is_returned_as_it_stands_never_re_executed(store: Store) -> None:
    op = store.claim(_new("u"), owner="w", lease=LEASE, possibly_sent=True).operation
    store.transition(op, State.OUTCOME_UNKNOWN, kind="provider_answer", actor="w")
    res = store.claim(_new("u"), owner="w2", lease=LEASE)
    assert not res.created and not res.replayed
    assert res.operation.state is State.OUTCOME_UNKNOWN
    assert res.operation.id == op.id


def test_stale_version_is_refused_and_leaves_state_and_events(store: Store) -> None:
    op = store.claim(_new(), owner="w", lease=LEASE).operation
    moved = store.transition(op, State.OUTCOME_UNKNOWN, kind="provider_answer", actor="w")
    assert moved.version == op.version + 1
    before_events = store.events("t1", op.id)
    with pytest.raises(StaleVersion):
        store.transition(op, State.SUCCEEDED, kind="provider_answer", actor="stale-worker")
    assert store.get("t1", op.id) == moved
    assert store.events("t1", op.id) == before_events


def test_terminal_operations_cannot_be_rewritten(store: Store) -> None:
    op = store.claim(_new(), owner="w", lease=LEASE).operation
    done = store.transition(op, State.FAILED_FINAL, kind="provider_answer", actor="w")
    with pytest.raises(InvalidTransition):
        store.transition(done, State.SUCCEEDED, kind="operator", actor="mallory")
    assert store.get("t1", op.id).state is State.FAILED_FINAL
    assert done.retain_until is not None and done.completed_at is not None


def test_bounded_wait_returns_the_outcome_once_recorded(store: Store) -> None:
    op = store.claim(_new("w"), owner="w", lease=LEASE).operation
    waiting = threading.Event()
    result: list[ClaimResult] = []

    def waiter() -> None:
        waiting.set()
        result.append(store.claim(_new("w"), owner="x", lease=LEASE, wait=timedelta(seconds=30)))

    t = threading.Thread(target=waiter)
    t.start()
    waiting.wait()
    store.transition(op, State.SUCCEEDED, kind="provider_answer", actor="w")
    t.join(timeout=60)
    assert result and result[0].replayed and result[0].operation.state is State.SUCCEEDED


def test_bounded_wait_gives_up_with_in_progress(store: Store) -> None:
    store.claim(_new("w"), owner="w", lease=LEASE)
    with pytest.raises(OperationInProgress) as info:
        store.claim(_new("w"), owner="x", lease=LEASE, wait=timedelta(milliseconds=200))
    assert info.value.http_status == 409


def test_events_are_append_only_and_ordered(store: Store) -> None:
    op = store.claim(_new(), owner="w", lease=LEASE).operation
    op = store.transition(
        op, State.IN_PROGRESS, kind="attempt", actor="w", lease=LEASE, lease_owner="w"
    )
    op = store.transition(op, State.OUTCOME_UNKNOWN, kind="provider_answer", actor="w")
    store.append_event(op, kind="late_answer", actor="stale", detail={"kind": "succeeded"})
    kinds = [e.kind for e in store.events("t1", op.id)]
    assert kinds == ["claimed", "attempt", "provider_answer", "late_answer"]
    assert store.get("t1", op.id).state is State.OUTCOME_UNKNOWN


@pytest.mark.slow
def test_four_processes_race_over_200_namespaces(postgres_url: str) -> None:
    keys = [f"ns-{i}" for i in range(200)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.starmap(workers.claim_many, [(postgres_url, w, keys) for w in range(4)])
    created = Counter(key for res in results for key, _, was_created in res if was_created)
    assert set(created) == set(keys)
    assert all(n == 1 for n in created.values())
    ids_per_key: dict[str, set[str]] = {}
    for res in results:
        for key, op_id, _ in res:
            ids_per_key.setdefault(key, set()).add(op_id)
    assert all(len(ids) == 1 for ids in ids_per_key.values())
    store = Store.from_url(postgres_url)
    try:
        assert _count(store, operations) == 200
    finally:
        store.close()


def test_migrations_round_trip(db_url: str, tmp_path: object) -> None:
    # A fresh database per dialect: upgrade, downgrade to nothing, upgrade again.
    url = db_url
    engine = sa.create_engine(url)
    citus = engine.dialect.name == "postgresql" and read_placement(engine).citus is not None
    try:
        # payorch_0007's downgrade stopped after it committed (on PostgreSQL its index is
        # dropped outside the transaction): recorded at 0007 still, it runs again.
        migrate.downgrade(url, "payorch_0006")
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE payorch_alembic_version SET version_num = 'payorch_0007'"))
        migrate.downgrade(url, "payorch_0006")
        assert not sa.inspect(engine).has_table("payorch_route_keys")
        migrate.downgrade(url, "base")
        assert not sa.inspect(engine).has_table("payorch_operations")
        migrate.upgrade(url)
        assert migrate.current_revision(url) == migrate.head_revision()
        names = set(sa.inspect(engine).get_table_names())
        assert {"payorch_operations", "payorch_events", "payorch_webhook_inbox"} <= names
    finally:
        engine.dispose()
        if citus:
            # The session's cluster, made local again by the round trip: placed again for
            # the tests after this one, whatever happened above.
            migrate.upgrade(url)
            migrate.distribute(url)


def test_migrations_match_table_definitions(db_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from payorch.storage._tables import metadata

    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"version_table": "payorch_alembic_version"}
            )
            diff = compare_metadata(context, metadata)
    finally:
        engine.dispose()
    assert diff == []


# The documented exceptions (docs/semantics.md, "Schema"): look-up by id alone. Not unique,
# so they constrain nothing across tenants and shard like any other index.
WITHOUT_TENANT = {
    "ix_payorch_outbox_id": (["id"], False),
    "ix_payorch_effects_id": (["id"], False),
}


def test_every_key_and_index_holds_the_tenant(db_url: str) -> None:
    """What distributing by tenant needs: every key holds tenant_id (a unique key without it
    could not be checked on one shard), and every index but the documented ones."""
    engine = sa.create_engine(db_url)
    try:
        insp = sa.inspect(engine)
        exceptions = {}
        tables = ("payorch_operations", "payorch_events", "payorch_webhook_inbox")
        for table in (*tables, "payorch_outbox", "payorch_effects", "payorch_route_keys"):
            assert "tenant_id" in insp.get_pk_constraint(table)["constrained_columns"]
            for uq in insp.get_unique_constraints(table):
                assert "tenant_id" in uq["column_names"]
            for ix in insp.get_indexes(table):
                if "tenant_id" not in ix["column_names"]:
                    exceptions[ix["name"]] = (ix["column_names"], bool(ix["unique"]))
        assert exceptions == WITHOUT_TENANT
    finally:
        engine.dispose()


def test_many_waiters_all_get_the_outcome_and_never_starve_the_holder(store: Store) -> None:
    op = store.claim(_new("crowd"), owner="holder", lease=LEASE).operation
    barrier = threading.Barrier(61)

    def waiter(_: int) -> ClaimResult:
        barrier.wait()
        return store.claim(_new("crowd"), owner="w", lease=LEASE, wait=timedelta(seconds=60))

    with ThreadPoolExecutor(max_workers=60) as pool:
        futures = [pool.submit(waiter, i) for i in range(60)]
        barrier.wait()
        store.transition(op, State.SUCCEEDED, kind="provider_answer", actor="holder")
        results = [f.result(timeout=120) for f in futures]
    assert all(r.replayed and r.operation.id == op.id for r in results)
