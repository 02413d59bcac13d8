"""The reconciler's scan cost against table size (PostgreSQL).

The operations table is filled with T terminal operations plus a fixed number of due
``outcome_unknown`` ones, ANALYZEd, and then:

* the exact statement that ``Store.claim_due`` sends (captured at the driver's cursor: the
  pick, ``SELECT ... FOR UPDATE SKIP LOCKED``, and the lease in one ``UPDATE ... FROM``) is
  run under ``EXPLAIN (ANALYZE, BUFFERS)``, and on its own in rolled-back transactions;
* ``Store.claim_due(limit=50)`` itself is timed (that statement, committed), the claimed
  operations being made due again between calls, outside the clock.

If the scan reads the partial index ``ix_payorch_operations_active`` its buffers stay flat
while T grows; a scan of the table would grow with T.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg

from payorch import Store
from payorch.storage import _pg_writes as pg_writes

ACTIVE_INDEX = "ix_payorch_operations_active"
OWNER = "bench-reconciler"
LEASE = timedelta(seconds=60)
BATCH = 50

_COLUMNS = """
    tenant_id, id, operation, idempotency_key, fingerprint, state, provider, downstream_key,
    provider_reference, amount, currency, request, response, error_code, resolution,
    retention_seconds, possibly_sent, attempts, checks, next_check_at, needs_attention,
    lease_owner, lease_expires_at, version, created_at, updated_at, completed_at,
    retain_until, reaped_at
"""

# Terminal operations as the executor leaves them: succeeded (9 in 10) or declined, lease
# released, no next check, retention set. Ids are UUIDv7-shaped and ascending, like new_id().
LOAD_TERMINAL = f"""
INSERT INTO payorch_operations ({_COLUMNS})
SELECT
    'tenant-' || mod(g, 20),
    u.id,
    'payment.create',
    'bulk-' || g,
    md5(g::text) || md5((g + 1)::text),
    CASE WHEN mod(g, 10) = 0 THEN 'failed_final' ELSE 'succeeded' END,
    'sandbox',
    'payorch:' || u.id || ':submit',
    'pay_' || g,
    1000 + mod(g, 5000),
    'EUR',
    json_build_object(
        'amount', 1000 + mod(g, 5000), 'currency', 'EUR', 'customer', 'cus_' || mod(g, 1000),
        'payment_method', 'pm_card_visa', 'capture_method', 'automatic',
        'description', NULL, 'metadata', '{{}}'::json),
    CASE WHEN mod(g, 10) = 0
        THEN json_build_object(
            'status', 'failed', 'http_status', 402, 'code', 'card_declined',
            'message', 'Your card was declined.', 'provider_reference', 'pay_' || g)
        ELSE json_build_object(
            'status', 'succeeded', 'http_status', 200, 'provider_reference', 'pay_' || g,
            'provider_response', NULL)
    END,
    CASE WHEN mod(g, 10) = 0 THEN 'card_declined' END,
    'provider_answer',
    2592000, true, 1, 0, NULL, false, NULL, NULL, 2,
    c.created, c.created + interval '80 ms', c.created + interval '80 ms',
    c.created + interval '30 days', NULL
FROM generate_series(%(start)s::bigint, %(stop)s::bigint - 1) AS g
CROSS JOIN LATERAL (
    SELECT '01900000-0000-7000-8000-' || lpad(to_hex(g), 12, '0') AS id) AS u
CROSS JOIN LATERAL (
    SELECT now() - make_interval(secs => (1000000 - g)::double precision) AS created) AS c
"""  # noqa: S608 - a constant column list, no input

# Due unknowns: possibly sent, no lease, next check an hour ago.
LOAD_DUE = f"""
INSERT INTO payorch_operations ({_COLUMNS})
SELECT
    'tenant-' || mod(g, 20),
    u.id,
    'payment.create',
    'due-' || g,
    md5(g::text) || md5((g + 1)::text),
    'outcome_unknown',
    'sandbox',
    'payorch:' || u.id || ':submit',
    NULL,
    1999,
    'EUR',
    json_build_object('amount', 1999, 'currency', 'EUR', 'payment_method', 'pm_card_visa'),
    NULL,
    'http_502',
    NULL,
    2592000, true, 1, 0,
    now() - interval '1 hour' - make_interval(secs => g::double precision),
    false, NULL, NULL, 2,
    now() - interval '2 hours', now() - interval '2 hours', NULL, NULL, NULL
FROM generate_series(1, %(count)s::bigint) AS g
CROSS JOIN LATERAL (
    SELECT '01900000-0000-7000-9000-' || lpad(to_hex(g), 12, '0') AS id) AS u
"""  # noqa: S608 - a constant column list, no input

# Make what claim_due leased due again (outside the clock).
RESET_CLAIMED = """
UPDATE payorch_operations
SET lease_owner = NULL, lease_expires_at = NULL,
    next_check_at = clock_timestamp() - interval '1 hour'
WHERE state IN ('in_progress', 'outcome_unknown') AND lease_owner IS NOT NULL
"""

SIZES_SQL = """
SELECT c.relpages, pg_relation_size('payorch_operations'),
       pg_total_relation_size('payorch_operations'), pg_relation_size(%s::regclass)
FROM pg_class c WHERE c.oid = 'payorch_operations'::regclass
"""


@dataclass(frozen=True, kw_only=True)
class ScanResult:
    terminal: int
    due: int
    heap_pages: int
    heap_mb: float
    total_mb: float  # heap + indexes + TOAST
    active_index_kb: float
    plan_chain: str
    uses_active_index: bool
    shared_hit: int
    shared_read: int
    explain_ms: float
    pick_p50_ms: float
    claim_p50_ms: float
    claim_p90_ms: float
    claimed_per_call: float
    # The same pick as on Citus (a read, then a lease per tenant), on this one node.
    two_step_p50_ms: float
    churn_buffers: int  # the scan's buffers after the claim_due repetitions, before VACUUM
    plan_text: list[str]


def load_due(conninfo: str, count: int) -> None:
    with psycopg.connect(conninfo) as conn:
        conn.execute(LOAD_DUE, {"count": count})


def load_terminal(conninfo: str, start: int, stop: int) -> None:
    """Terminal operations numbered ``start .. stop-1``, in batches of 100k rows."""
    with psycopg.connect(conninfo) as conn:
        for lo in range(start, stop, 100_000):
            conn.execute(LOAD_TERMINAL, {"start": lo, "stop": min(stop, lo + 100_000)})
            conn.commit()


def vacuum_analyze(conninfo: str) -> None:
    """VACUUM that also cleans the indexes: PostgreSQL 14+ may otherwise skip index vacuuming
    when few pages hold dead tuples, leaving dead entries in the small active index."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE, INDEX_CLEANUP ON) payorch_operations")


def renew_due(conninfo: str, count: int) -> None:
    """Replace the active operations with ``count`` fresh due ones, so every size starts from
    the same state (the previous size's claim_due repetitions moved them around)."""
    with psycopg.connect(conninfo) as conn:
        conn.execute(
            "DELETE FROM payorch_operations WHERE state IN ('in_progress', 'outcome_unknown')"
        )
    vacuum_analyze(conninfo)
    load_due(conninfo, count)


def reset_claimed(conninfo: str) -> None:
    with psycopg.connect(conninfo) as conn:
        conn.execute(RESET_CLAIMED)


def capture_pick(store: Store) -> tuple[str, Mapping[str, Any]]:
    """Run ``claim_due`` once and keep the statement with ``FOR UPDATE SKIP LOCKED`` it sent
    (seen by a recording psycopg cursor on a second store for the same database)."""
    seen: list[tuple[str, Mapping[str, Any]]] = []

    class Recording(psycopg.Cursor[Any]):
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            statement = str(query)
            if not seen and "SKIP LOCKED" in statement.upper():
                seen.append((statement, dict(params or {})))
            return super().execute(query, params, **kwargs)

    probe = Store.from_url(store.engine.url, connect_args={"cursor_factory": Recording})
    try:
        probe.claim_due(owner=OWNER, lease=LEASE, limit=BATCH)
    finally:
        probe.close()
    if not seen:
        raise RuntimeError("claim_due sent no SELECT ... FOR UPDATE SKIP LOCKED")
    return seen[0]


def _walk(node: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _walk(child)


def _describe(node: Mapping[str, Any]) -> str:
    name = str(node["Node Type"])
    if "Index Name" in node:
        return f"{name} ({node['Index Name']})"
    if "Relation Name" in node:
        return f"{name} ({node['Relation Name']})"
    return name


def explain(conninfo: str, statement: str, params: Mapping[str, Any]) -> tuple[Any, list[str]]:
    """The JSON and the text plan of ``statement``, executed and rolled back (it locks rows)."""
    with psycopg.connect(conninfo) as conn:
        with conn.transaction(force_rollback=True):
            row = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, params
            ).fetchone()
        with conn.transaction(force_rollback=True):
            text = [
                str(r[0])
                for r in conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + statement, params).fetchall()
            ]
    if row is None:
        raise RuntimeError("EXPLAIN returned nothing")
    return row[0][0], text


def time_pick(conninfo: str, statement: str, params: Mapping[str, Any], reps: int) -> float:
    """Median milliseconds of the scan alone (rolled back, so it leases nothing)."""
    times: list[float] = []
    with psycopg.connect(conninfo) as conn:
        for _ in range(reps):
            with conn.transaction(force_rollback=True):
                began = time.perf_counter()
                conn.execute(statement, params).fetchall()
                times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def time_claim_due(
    store: Store, conninfo: str, reps: int, *, two_step: bool = False
) -> tuple[float, float, float]:
    """Median and p90 milliseconds of ``claim_due(limit=50)``, and rows claimed per call;
    ``two_step``: the pick a distributed schema uses (a read, then a lease per tenant)."""
    times: list[float] = []
    claimed: list[int] = []
    for _ in range(reps):
        reset_claimed(conninfo)
        began = time.perf_counter()
        if two_step:
            batch, _ = pg_writes.claim_due(
                store.engine,
                owner=OWNER,
                lease_s=LEASE.total_seconds(),
                limit=BATCH,
                tenant_ids=None,
                distributed=True,
            )
        else:
            batch = store.claim_due(owner=OWNER, lease=LEASE, limit=BATCH)
        times.append(time.perf_counter() - began)
        claimed.append(len(batch))
    reset_claimed(conninfo)
    ordered = sorted(times)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return statistics.median(times) * 1000, p90 * 1000, statistics.mean(claimed)


def _buffers(plan: Mapping[str, Any]) -> tuple[int, int]:
    top = plan["Plan"]
    return int(top.get("Shared Hit Blocks", 0)), int(top.get("Shared Read Blocks", 0))


def measure_size(
    store: Store,
    conninfo: str,
    pick: tuple[str, Mapping[str, Any]],
    *,
    terminal: int,
    due: int,
    pick_reps: int,
    claim_reps: int,
) -> ScanResult:
    statement, params = pick
    renew_due(conninfo, due)
    vacuum_analyze(conninfo)
    plan, text = explain(conninfo, statement, params)
    nodes = list(_walk(plan["Plan"]))
    hit, read = _buffers(plan)
    pick_ms = time_pick(conninfo, statement, params, pick_reps)
    claim_p50, claim_p90, per_call = time_claim_due(store, conninfo, claim_reps)
    two_step, _, _ = time_claim_due(store, conninfo, claim_reps, two_step=True)
    churned, _ = explain(conninfo, statement, params)
    with psycopg.connect(conninfo) as conn:
        sizes = conn.execute(SIZES_SQL, (ACTIVE_INDEX,)).fetchone()
    if sizes is None:
        raise RuntimeError("payorch_operations is missing from pg_class")
    relpages, heap_bytes, total_bytes, index_bytes = sizes
    return ScanResult(
        terminal=terminal,
        due=due,
        heap_pages=int(relpages),
        heap_mb=heap_bytes / 2**20,
        total_mb=total_bytes / 2**20,
        active_index_kb=index_bytes / 1024,
        plan_chain=" > ".join(_describe(n) for n in nodes),
        uses_active_index=any(n.get("Index Name") == ACTIVE_INDEX for n in nodes),
        shared_hit=hit,
        shared_read=read,
        explain_ms=float(plan.get("Execution Time", 0.0)),
        pick_p50_ms=pick_ms,
        claim_p50_ms=claim_p50,
        claim_p90_ms=claim_p90,
        claimed_per_call=per_call,
        two_step_p50_ms=two_step,
        churn_buffers=sum(_buffers(churned)),
        plan_text=text,
    )


def run_scan(
    url: str,
    conninfo: str,
    sizes: tuple[int, ...],
    *,
    due: int,
    pick_reps: int,
    claim_reps: int,
    progress: Callable[[str], None] | None = None,
) -> list[ScanResult]:
    """Grow the table through ``sizes`` terminal operations, measuring at each size."""
    store = Store.from_url(url)
    results: list[ScanResult] = []
    loaded = 0
    try:
        load_due(conninfo, due)
        pick = capture_pick(store)  # the statement does not depend on the table's size
        for size in sorted(sizes):
            if size > loaded:
                began = time.perf_counter()
                load_terminal(conninfo, loaded, size)
                if progress is not None:
                    progress(
                        f"scan: loaded {size - loaded:,} terminal operations "
                        f"in {time.perf_counter() - began:.1f}s; measuring at {size:,}"
                    )
                loaded = size
            results.append(
                measure_size(
                    store,
                    conninfo,
                    pick,
                    terminal=size,
                    due=due,
                    pick_reps=pick_reps,
                    claim_reps=claim_reps,
                )
            )
    finally:
        store.close()
    return results
