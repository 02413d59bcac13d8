"""Plan shapes of the hot queries at table sizes where a scan would show (>= 100k rows).

The tables are filled server-side (PostgreSQL ``generate_series``, SQLite a recursive CTE)
and analysed; then each hot query is run for real through the code that issues it, the SQL
it sent is captured, and its ``EXPLAIN`` must read the expected index and never scan a whole
table. Plans, not timings: a plan is what decides how the cost grows with the table.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from conftest import create_pg_database
from sent_sql import RecordingCursor, Sent, one, sent_by

from payorch import migrate
from payorch.records import NewOperation
from payorch.storage._queries import list_operations
from payorch.storage._retention import reap
from payorch.storage._store import Store

pytestmark = pytest.mark.slow

ROWS = 120_000  # operations; one event each, a webhook delivery for every tenth
TENANTS = 20

# Per row i: 1% outcome_unknown, 1% in_progress (both due), 1% past retention, 0.2% flagged;
# the rest terminal and retained for 30 more days.
_PG_FILL = f"""
INSERT INTO payorch_operations (
    tenant_id, id, operation, idempotency_key, fingerprint, state, provider, downstream_key,
    provider_reference, amount, currency, request, response, retention_seconds, possibly_sent,
    attempts, checks, next_check_at, needs_attention, lease_expires_at, version, created_at,
    updated_at, completed_at, retain_until)
SELECT
    'tenant-' || mod(i, {TENANTS}), 'op-' || i, 'payment.create', 'key-' || i,
    md5(i::text) || md5(i::text),
    CASE WHEN mod(i, 100) = 0 THEN 'outcome_unknown' WHEN mod(i, 100) = 1 THEN 'in_progress'
         WHEN mod(i, 2) = 0 THEN 'succeeded' ELSE 'failed_final' END,
    'sandbox', 'payorch:op-' || i || ':1', 'ref_' || i, 1000, 'EUR', '{{"amount": 1000}}',
    '{{"status": "ok"}}', 2592000, true, 1, 0,
    CASE WHEN mod(i, 100) IN (0, 1) THEN now() - make_interval(secs => mod(i, 600)) END,
    mod(i, 500) = 3,
    CASE WHEN mod(i, 100) = 1 THEN now() - interval '1 minute' END,
    2, now() - make_interval(secs => i), now() - make_interval(secs => i),
    CASE WHEN mod(i, 100) > 1 THEN now() - make_interval(secs => i) END,
    CASE WHEN mod(i, 100) = 2 THEN now() - interval '1 hour'
         WHEN mod(i, 100) > 1 THEN now() + interval '30 days' END
FROM generate_series(1, {ROWS}) AS i;
INSERT INTO payorch_events (tenant_id, id, operation_id, kind, actor, to_state, version, detail,
    created_at)
SELECT 'tenant-' || mod(i, {TENANTS}), 'ev-' || i, 'op-' || i, 'claimed', 'w', 'in_progress', 1,
    '{{"k": 1}}', now() - make_interval(secs => i)
FROM generate_series(1, {ROWS}) AS i;
INSERT INTO payorch_webhook_inbox (tenant_id, provider, event_id, event_type, operation_id,
    result, body, received_at)
SELECT 'tenant-' || mod(i, {TENANTS}), 'sandbox', 'evt_' || i, 'payment.succeeded', 'op-' || i,
    'applied', '{{"id": 1}}', now() - make_interval(secs => i)
FROM generate_series(10, {ROWS}, 10) AS i;
ANALYZE;
"""


def _ts(seconds: str) -> str:
    """SQLite's stored form of now + ``seconds`` (the text SQLAlchemy writes)."""
    return f"(strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+d seconds', {seconds})) || '000')"


_SQLITE_SERIES = f"WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {ROWS})"
_SQLITE_FILL = [
    f"""{_SQLITE_SERIES}
INSERT INTO payorch_operations (
    tenant_id, id, operation, idempotency_key, fingerprint, state, provider, downstream_key,
    provider_reference, amount, currency, request, response, retention_seconds, possibly_sent,
    attempts, checks, next_check_at, needs_attention, lease_expires_at, version, created_at,
    updated_at, completed_at, retain_until, replays)
SELECT
    'tenant-' || (i % {TENANTS}), 'op-' || i, 'payment.create', 'key-' || i,
    printf('%064d', i),
    CASE WHEN i % 100 = 0 THEN 'outcome_unknown' WHEN i % 100 = 1 THEN 'in_progress'
         WHEN i % 2 = 0 THEN 'succeeded' ELSE 'failed_final' END,
    'sandbox', 'payorch:op-' || i || ':1', 'ref_' || i, 1000, 'EUR', '{{"amount": 1000}}',
    '{{"status": "ok"}}', 2592000, 1, 1, 0,
    CASE WHEN i % 100 IN (0, 1) THEN {_ts("-(i % 600)")} END,
    i % 500 = 3,
    CASE WHEN i % 100 = 1 THEN {_ts("-60")} END,
    2, {_ts("-i")}, {_ts("-i")},
    CASE WHEN i % 100 > 1 THEN {_ts("-i")} END,
    CASE WHEN i % 100 = 2 THEN {_ts("-3600")} WHEN i % 100 > 1 THEN {_ts("2592000")} END,
    0
FROM n""",
    f"""{_SQLITE_SERIES}
INSERT INTO payorch_events (tenant_id, id, operation_id, kind, actor, to_state, version, detail,
    created_at)
SELECT 'tenant-' || (i % {TENANTS}), 'ev-' || i, 'op-' || i, 'claimed', 'w', 'in_progress', 1,
    '{{"k": 1}}', {_ts("-i")}
FROM n""",
    f"""{_SQLITE_SERIES}
INSERT INTO payorch_webhook_inbox (tenant_id, provider, event_id, event_type, operation_id,
    result, body, received_at)
SELECT 'tenant-' || (i % {TENANTS}), 'sandbox', 'evt_' || i, 'payment.succeeded', 'op-' || i,
    'applied', '{{"id": 1}}', {_ts("-i")}
FROM n WHERE i % 10 = 0""",
    "ANALYZE",
]


def _fill(engine: sa.Engine) -> None:
    raw = engine.raw_connection()  # the DB-API cursor: no parameter parsing of the SQL
    try:
        cur = raw.cursor()
        if engine.dialect.name == "postgresql":
            cur.execute(_PG_FILL)
        else:
            for statement in _SQLITE_FILL:
                cur.execute(statement)
        raw.commit()
    finally:
        raw.close()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def big(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Store]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('plans') / 'big.db'}"
    else:
        url = create_pg_database(request.getfixturevalue("pg_server_url"), prefix="payorch_plans")
    migrate.upgrade(url)
    store = (
        Store.from_url(url)
        if request.param == "sqlite"
        else Store.from_url(url, connect_args={"cursor_factory": RecordingCursor})
    )
    try:
        _fill(store.engine)
        with store.engine.connect() as conn:
            count = conn.execute(sa.text("SELECT count(*) FROM payorch_operations")).scalar_one()
        assert count == ROWS
        yield store
    finally:
        store.close()


def plan(store: Store, sent: Sent) -> list[str]:
    raw = store.engine.raw_connection()
    try:
        cur = raw.cursor()
        if store.is_postgres:
            cur.execute("EXPLAIN " + sent.statement, sent.parameters)
        else:
            cur.execute("EXPLAIN QUERY PLAN " + sent.statement, sent.parameters)
        lines = [str(row[-1]) for row in cur.fetchall()]
        raw.rollback()
        return lines
    finally:
        raw.close()


_SQLITE_FULL_SCAN = re.compile(r"^SCAN (payorch_\w+)$")


def assert_reads_index(store: Store, sent: Sent, index: str) -> None:
    lines = plan(store, sent)
    shown = "\n".join(lines)
    context = f"{sent.statement}\n--- plan ---\n{shown}"
    if store.is_postgres:
        assert "Seq Scan" not in shown, context
    else:
        assert not any(_SQLITE_FULL_SCAN.match(line.strip()) for line in lines), context
    assert index in shown, context


def primary_key(store: Store) -> str:
    return "pk_payorch_operations" if store.is_postgres else "autoindex_payorch_operations_1"


def namespace_index(store: Store) -> str:
    # SQLite names a UNIQUE constraint's index itself (the primary key's is _1).
    return (
        "uq_payorch_operations_namespace" if store.is_postgres else "autoindex_payorch_operations_2"
    )


# -- the reconciler ------------------------------------------------------------------------


def test_claim_due_reads_the_active_partial_index(big: Store) -> None:
    def scan(store: Store) -> object:
        return store.claim_due(owner="plans", lease=timedelta(seconds=30), limit=10)

    sent = sent_by(big, scan)
    pick = one(sent, "next_check_at <=", "ORDER BY")
    assert "IN ('in_progress', 'outcome_unknown')" in pick.statement  # literals, as indexed
    assert_reads_index(big, pick, "ix_payorch_operations_active")


def test_claim_due_for_some_tenants_reads_the_active_partial_index(big: Store) -> None:
    def scan(store: Store) -> object:
        return store.claim_due(
            owner="plans", lease=timedelta(seconds=30), limit=10, tenant_ids={"tenant-3"}
        )

    pick = one(sent_by(big, scan), "next_check_at <=", "ORDER BY")
    assert_reads_index(big, pick, "ix_payorch_operations_active")


# -- operators ---------------------------------------------------------------------------


def test_find_by_id_alone_reads_the_primary_key(big: Store) -> None:
    sent = sent_by(big, lambda store: store.find("op-77777"))
    assert_reads_index(big, one(sent, "FROM payorch_operations"), primary_key(big))


def test_a_tenant_listing_reads_the_listing_index(big: Store) -> None:
    def listing(store: Store) -> object:
        page = list_operations(store, tenant_id="tenant-3", limit=20)
        assert len(page.items) == 20 and all(r.tenant_id == "tenant-3" for r in page.items)
        return page

    query = one(sent_by(big, listing), "FROM payorch_operations", "ORDER BY")
    assert_reads_index(big, query, "ix_payorch_operations_created")


@pytest.mark.parametrize("tenant", [None, "tenant-3"])
def test_needs_attention_listing_reads_the_attention_index(big: Store, tenant: str | None) -> None:
    def listing(store: Store) -> object:
        page = list_operations(store, needs_attention=True, tenant_id=tenant, limit=20)
        assert page.items and all(r.needs_attention for r in page.items)
        return page

    query = one(sent_by(big, listing), "FROM payorch_operations", "ORDER BY")
    assert_reads_index(big, query, "ix_payorch_operations_attention")


def test_find_by_reference_reads_the_reference_index(big: Store) -> None:
    def find(store: Store) -> object:
        found = store.find_by_reference("tenant-3", "sandbox", "ref_4003")
        assert found is not None and found.id == "op-4003"
        return found

    query = one(sent_by(big, find), "FROM payorch_operations")
    assert_reads_index(big, query, "ix_payorch_operations_provider_reference")


def test_find_by_key_reads_the_namespace_index(big: Store) -> None:
    def find(store: Store) -> object:
        return store.get_by_namespace("tenant-3", "payment.create", "key-4003")

    query = one(sent_by(big, find), "FROM payorch_operations")
    assert_reads_index(big, query, namespace_index(big))


# -- the reaper ----------------------------------------------------------------------------


def test_the_retention_scan_reads_the_retention_index(big: Store) -> None:
    sent = sent_by(big, lambda store: reap(store, dry_run=True, limit=5))
    tenants = one(sent, "WITH RECURSIVE")
    assert_reads_index(big, tenants, "ix_payorch_operations_retention")
    due = [s for s in sent if "retain_until <=" in s.statement]
    assert due
    for query in due:
        assert_reads_index(big, query, "ix_payorch_operations_retention")


def test_stripping_bodies_reads_the_operation_indexes(big: Store) -> None:
    sent = sent_by(big, lambda store: reap(store, limit=1))
    assert_reads_index(big, one(sent, "UPDATE payorch_events"), "ix_payorch_events_operation")
    assert_reads_index(
        big, one(sent, "UPDATE payorch_webhook_inbox"), "ix_payorch_webhook_inbox_operation"
    )


# -- replays -------------------------------------------------------------------------------


def test_a_replay_is_counted_through_the_namespace_index(big: Store) -> None:
    def replay(store: Store) -> object:
        row = store.get("tenant-4", "op-4004")
        new = NewOperation(
            tenant_id=row.tenant_id,
            operation=row.operation,
            idempotency_key=row.idempotency_key,
            fingerprint=row.fingerprint,
            provider=row.provider,
            amount=row.amount,
            currency=row.currency,
            request=None,
            retention=timedelta(days=30),
        )
        result = store.claim(new, owner="plans", lease=timedelta(seconds=30))
        assert result.replayed
        return result

    update = one(sent_by(big, replay), "UPDATE payorch_operations", "replays")
    assert_reads_index(big, update, namespace_index(big))
