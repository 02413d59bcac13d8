"""A fresh, never-analyzed database beside an analyzed one: ``execute()`` over the same number
of operations of one tenant, one thread, ops/s per chunk.

The rest of the benchmark ANALYZEs after its warm-up (what autovacuum does in a live
database's first minute). This runs once without it: each arm gets a new database with
autovacuum off on payorch's tables, so the fresh one stays never analyzed for the whole run
and the analyzed one is analyzed once, after a warm-up of one chunk. A plan that depends on
statistics shows as a fresh arm whose chunks slow down as the table grows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import bench_db
import bench_execute as bx
import psycopg
from rich.console import Console
from rich.table import Table

from payorch import Executor, Store

__all__ = ["FreshResult", "print_fresh", "run_fresh"]

CHUNK = 1000
_TABLES = ("payorch_operations", "payorch_events")


@dataclass(frozen=True, kw_only=True)
class FreshResult:
    arm: str  # "fresh" (never analyzed) or "analyzed"
    ops: int
    ops_per_s: float  # over all chunks
    chunks: list[float]  # ops/s of each chunk of CHUNK operations, in order

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_fresh(
    server: bench_db.Server,
    ops: int,
    tenant: str,
    make_executor: Callable[[Store, str], Executor],
    say: Callable[[str], None],
) -> list[FreshResult]:
    results: list[FreshResult] = []
    for arm in ("fresh", "analyzed"):
        with bench_db.fresh_database(server, f"payorch_bench_{arm}") as db:
            with psycopg.connect(db.conninfo, autocommit=True) as conn:
                for table in _TABLES:  # stays as the arm says for the whole run
                    conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
            store = Store.from_url(db.url)
            try:
                workload = bx.execute_workload(make_executor(store, f"bench-{arm}"), tenant)
                if arm == "analyzed":
                    bx.run_threads(1, CHUNK, workload(f"{arm}-warm"))
                    bench_db.analyze(db.conninfo)
                say(f"fresh vs analyzed: {ops:,} operations of one tenant, {arm}")
                chunks: list[float] = []
                seconds = 0.0
                done = 0
                while done < ops:
                    n = min(CHUNK, ops - done)
                    run = bx.run_threads(1, n, workload(f"{arm}-{done}"))
                    chunks.append(run.ops_per_s)
                    seconds += run.seconds
                    done += n
                results.append(
                    FreshResult(arm=arm, ops=ops, ops_per_s=ops / seconds, chunks=chunks)
                )
            finally:
                store.close()
    return results


def print_fresh(console: Console, results: list[FreshResult]) -> None:
    if not results:
        return
    table = Table(
        title=(
            "PostgreSQL: execute() on a fresh, never-analyzed database and on an analyzed one "
            "(one tenant, one thread)"
        ),
        title_justify="left",
    )
    for col in ("arm", "ops", "ops/s", "first chunk", "last chunk", "last / first"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for r in results:
        first, last = r.chunks[0], r.chunks[-1]
        table.add_row(
            r.arm,
            f"{r.ops:,}",
            f"{r.ops_per_s:,.0f}",
            f"{first:,.0f}",
            f"{last:,.0f}",
            f"{last / first:.2f}" if first else "-",
        )
    console.print(table)
    console.print(
        f"  Chunks of {CHUNK:,} operations; autovacuum off on payorch's tables in both "
        "databases; the analyzed one analyzed once after a warm-up chunk."
    )


def fresh_ratio(results: list[FreshResult]) -> float | None:
    by_arm = {r.arm: r for r in results}
    fresh, analyzed = by_arm.get("fresh"), by_arm.get("analyzed")
    if fresh is None or analyzed is None or not analyzed.ops_per_s:
        return None
    return fresh.ops_per_s / analyzed.ops_per_s
