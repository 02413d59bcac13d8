"""Plans that do not depend on statistics: the hot statements' generic plans on a table that
has never been analyzed.

PostgreSQL caches one generic plan per prepared statement (psycopg prepares a statement on
its fifth run), chosen while a fresh table is tiny and every index looks equally cheap; it
stays in use until something (an ANALYZE) replans it. A by-key write whose cached plan walks
a tenant's entries of another index slows down with every operation written. Each statement
here is run for real, then its generic plan is read (``plan_cache_mode =
force_generic_plan``): it must read the one index that names its row, and no other.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from conftest import create_pg_database
from psycopg import sql
from sent_sql import RecordingCursor, Sent, one, sent_by

from payorch import migrate
from payorch.core import State
from payorch.errors import OperationInProgress
from payorch.records import NewOperation
from payorch.storage._queries import list_operations
from payorch.storage._store import Store

TENANT = "fresh-shop"
LEASE = timedelta(seconds=30)
PK = "pk_payorch_operations"
NAMESPACE = "uq_payorch_operations_namespace"
_PARAM = re.compile(r"%\((\w+)\)s")
_INDEX = re.compile(
    r"(?:Index Scan|Index Only Scan|Bitmap Index Scan)(?: Backward)? (?:using|on) (\w+)"
)


@pytest.fixture
def fresh(pg_server_url: str) -> Iterator[Store]:
    url = create_pg_database(pg_server_url, prefix="payorch_fresh")
    migrate.upgrade(url)
    store = Store.from_url(url, connect_args={"cursor_factory": RecordingCursor})
    with store.engine.connect() as conn:  # never analyzed while the test runs
        conn.exec_driver_sql("ALTER TABLE payorch_operations SET (autovacuum_enabled = false)")
        conn.commit()
    try:
        for i in range(20):  # a few rows: the size at which a plan gets cached
            _succeed(store, f"seed-{i}")
        yield store
    finally:
        store.close()


def _new(key: str) -> NewOperation:
    return NewOperation(
        tenant_id=TENANT,
        operation="payment.create",
        idempotency_key=key,
        fingerprint="f" * 64,
        provider="sandbox",
        amount=1000,
        currency="EUR",
        request={"amount": 1000},
    )


def _succeed(store: Store, key: str) -> Any:
    record = store.claim(_new(key), owner="fresh", lease=LEASE).operation
    return store.transition(
        record,
        State.SUCCEEDED,
        kind="provider_answer",
        actor="fresh",
        provider_reference=f"ref-{key}",
        response={"status": "succeeded"},
        first_answer=True,
    )


def generic_plan(store: Store, sent: Sent) -> str:
    """``sent``'s generic plan: prepared with ``$n`` parameters, explained with its values."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    text = _PARAM.sub(number, sent.statement).replace("%%", "%")
    raw = store.engine.raw_connection()
    try:
        conn: psycopg.Connection[Any] = raw.driver_connection  # type: ignore[assignment]
        with conn.transaction(force_rollback=True):
            conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            conn.execute(sql.SQL("PREPARE fresh_plan AS {}").format(sql.SQL(text)))
            values = sql.SQL(", ").join(sql.Literal(sent.parameters[n]) for n in names)
            explain = (
                sql.SQL("EXPLAIN EXECUTE fresh_plan({})").format(values)
                if names
                else (sql.SQL("EXPLAIN EXECUTE fresh_plan"))
            )
            lines = [str(row[0]) for row in conn.execute(explain).fetchall()]
            conn.execute("DEALLOCATE fresh_plan")
        return "\n".join(lines)
    finally:
        raw.close()


def assert_reads_only(store: Store, sent: Sent, *indexes: str) -> None:
    shown = generic_plan(store, sent)
    context = f"{sent.statement}\n--- generic plan ---\n{shown}"
    assert "Seq Scan on payorch_operations" not in shown, context
    read = {
        name
        for name in _INDEX.findall(shown)
        if name.startswith(
            ("pk_payorch_operations", "uq_payorch_operations", "ix_payorch_operations")
        )
    }
    assert read == set(indexes), context


def test_a_claim_reads_only_the_namespace(fresh: Store) -> None:
    sent = sent_by(fresh, lambda store: store.claim(_new("one"), owner="fresh", lease=LEASE))
    assert_reads_only(fresh, one(sent, "INSERT INTO payorch_operations"), NAMESPACE)


def test_a_replay_reads_only_the_namespace(fresh: Store) -> None:
    sent = sent_by(fresh, lambda store: store.claim(_new("seed-3"), owner="fresh", lease=LEASE))
    assert_reads_only(fresh, one(sent, "INSERT INTO payorch_operations"), NAMESPACE)


@pytest.mark.parametrize(
    ("state", "answer"),
    [
        (
            State.SUCCEEDED,
            {"provider_reference": "ref-two", "response": {"status": "succeeded"}},
        ),
        (State.OUTCOME_UNKNOWN, {"next_check_in": timedelta(seconds=5)}),
    ],
    ids=["succeeded", "unknown"],
)
def test_the_outcome_write_reads_only_the_primary_key(
    fresh: Store, state: State, answer: dict[str, Any]
) -> None:
    record = fresh.claim(_new(f"answer-{state.value}"), owner="fresh", lease=LEASE).operation

    def write(store: Store) -> object:
        return store.transition(
            record, state, kind="provider_answer", actor="fresh", first_answer=True, **answer
        )

    assert_reads_only(fresh, one(sent_by(fresh, write), "UPDATE payorch_operations"), PK)


def test_a_waiter_marks_and_rereads_by_the_primary_key(fresh: Store) -> None:
    fresh.claim(_new("four"), owner="holder", lease=LEASE)

    def wait(store: Store) -> object:  # the lease is held: the wait ends in_progress
        with pytest.raises(OperationInProgress):
            store.claim(_new("four"), owner="waiter", lease=LEASE, wait=timedelta(milliseconds=50))
        return None

    sent = sent_by(fresh, wait)
    assert_reads_only(fresh, one(sent, "SET waited = true"), PK)
    rereads = [s for s in sent if "replays = replays + %(replays)s" in s.statement]
    assert rereads
    for reread in rereads:
        assert_reads_only(fresh, reread, PK)


@pytest.mark.parametrize(
    ("look_up", "index"),
    [
        (
            lambda store: store.find(store.get_by_namespace(TENANT, "payment.create", "seed-5").id),
            PK,
        ),
        (lambda store: store.get_by_namespace(TENANT, "payment.create", "seed-5"), NAMESPACE),
        (
            lambda store: store.find_by_reference(TENANT, "sandbox", "ref-seed-5"),
            "ix_payorch_operations_provider_reference",
        ),
    ],
    ids=["by-id", "by-key", "by-reference"],
)
def test_look_ups_read_only_their_index(fresh: Store, look_up: Any, index: str) -> None:
    sent = [s for s in sent_by(fresh, look_up) if "FROM payorch_operations" in s.statement]
    assert_reads_only(fresh, sent[-1], index)


def test_a_webhook_finds_its_operation_by_the_downstream_index(fresh: Store) -> None:
    key = fresh.get_by_namespace(TENANT, "payment.create", "seed-6").downstream_key
    sent = sent_by(fresh, lambda store: store.find_by_downstream_key(TENANT, "sandbox", key))
    assert_reads_only(
        fresh, one(sent, "FROM payorch_operations"), "ix_payorch_operations_downstream"
    )


def test_the_listing_reads_only_the_listing_index(fresh: Store) -> None:
    sent = sent_by(fresh, lambda store: list_operations(store, tenant_id=TENANT, limit=5))
    query = one(sent, "FROM payorch_operations", "ORDER BY")
    assert_reads_only(fresh, query, "ix_payorch_operations_created")


def test_the_reconciler_pick_is_planned_on_each_run(fresh: Store) -> None:
    """The pick's best plan changes as the table grows (a scan of a tiny table, the active
    index of a large one): it is sent never to be prepared, so each run is planned for the
    table as it is; the by-key statements may be prepared (their one index is right)."""

    def scans(store: Store) -> None:
        store.claim_due(owner="fresh", lease=LEASE, limit=10)
        store.claim_due(owner="fresh", lease=LEASE, limit=10, tenant_ids={TENANT})
        _succeed(store, "more")

    sent = sent_by(fresh, scans)
    picks = [s for s in sent if "next_check_at <=" in s.statement]
    assert len(picks) == 2 and all(s.prepare is False for s in picks)
    assert one(sent, "INSERT INTO payorch_operations").prepare is None


def test_the_gauges_are_planned_on_each_scrape(fresh: Store) -> None:
    """The scrape's counts read partial indexes that a generic plan chosen on a fresh, tiny
    table would skip for a scan of the whole table: its transaction (only) plans them per
    run, set by its first statement."""
    gauges: list[dict[str, Any]] = []
    sent = sent_by(fresh, lambda store: gauges.append(store.read_gauges()))
    first = next(s for s in sent if "set_config" in s.statement)
    assert sorted(map(str, first.parameters.values())) == [
        "True",
        "force_custom_plan",
        "plan_cache_mode",
    ]  # transaction-local
    assert gauges[0]["attention"] == 0 and gauges[0]["by_state"]["in_progress"] == 0
