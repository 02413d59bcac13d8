"""How the benchmark run's figures are printed (the report half of run.py): the sections of
its own, then each other module's (bench_metrics, bench_tracing, bench_async_http) in turn."""

from __future__ import annotations

import bench_scan
from bench_async_http import print_async_http
from bench_metrics import print_metrics
from bench_tracing import print_tracing
from figures import Options, Report, extra_ms, lat, ops, ratio, ratio_range, table
from rich.console import Console

__all__ = ["print_report"]


def _print_header(console: Console, report: Report, opts: Options) -> None:
    env = report.environment
    console.rule("[bold]payorch benchmarks")
    console.print(
        f"{env['cpus']} CPUs ({env['machine']}), Python {env['python']}, "
        f"SQLAlchemy {env['sqlalchemy']}, psycopg {env['psycopg']}, SQLite {env['sqlite']}; "
        f"load average {env['load_before']} before, {env.get('load_after', '?')} after"
    )
    if "pg_version" in env:
        console.print(f"PostgreSQL {env['pg_version']} from {env['pg_origin']}")
        console.print(
            f"[bold yellow]server settings: fsync={env['fsync']} "
            f"synchronous_commit={env['synchronous_commit']} "
            f"full_page_writes={env['full_page_writes']} "
            f"wal_sync_method={env.get('wal_sync_method', '?')}[/] "
            f"shared_buffers={env['shared_buffers']}"
        )
        if env["fsync"] == "off" or env["synchronous_commit"] == "off":
            console.print(
                "[yellow]  commits do not wait for the disk here: absolute figures are flattered, "
                "for execute() and the floors alike.\n"
                "  Both commit twice per operation, so a real commit latency adds about the same "
                "time to each and pulls execute/floor towards 1."
            )
    console.print(
        f"operations per configuration: PostgreSQL {opts.ops:,} single-threaded, "
        f"{opts.threaded_ops:,} multi-threaded; SQLite {opts.sqlite_ops:,}; replays "
        f"{opts.replay_ops:,}; HTTP {opts.http_ops:,}; async HTTP {opts.async_ops:,} per arm "
        f"and N in flight ({', '.join(map(str, opts.in_flight))}).\n"
        f"Each configuration runs its workloads in {opts.rounds} alternating rounds (after "
        f"{opts.warmup} untimed warm-up operations each), so drift hits them alike; the\n"
        "min-max of the per-round ratio is shown. Client threads, database server and "
        "provider share the CPUs; latencies are per operation, p50 / p99 ms."
    )


def _print_postgres(console: Console, report: Report, opts: Options) -> None:
    t = table(
        "PostgreSQL: execute() (instant in-process provider) vs the raw psycopg floor, one "
        "statement per phase (ops/s; p50 / p99 ms)",
        (
            "threads",
            "floor",
            "p50 / p99",
            "same SQL",
            "execute()",
            "p50 / p99 ",
            "execute/floor",
            "per round",
            "exec/same SQL",
            "+ms/op",
            "no pre-ping",
            "no-ping/floor",
            "CPU ms/op e / f",
        ),
        bold=("execute/floor",),
    )
    for n in opts.threads:
        floor = report.result("postgres", n, "floor")
        shaped = report.result("postgres", n, "shaped")
        fresh = report.result("postgres", n, "execute")
        unpinged = report.result("postgres", n, "execute_noping")
        t.add_row(
            str(n),
            ops(floor),
            lat(floor),
            ops(shaped),
            ops(fresh),
            lat(fresh),
            ratio(fresh, floor),
            ratio_range(report, "postgres", n, "execute", "floor"),
            ratio(fresh, shaped),
            extra_ms(fresh, floor),
            ops(unpinged),
            ratio(unpinged, floor),
            f"{fresh.cpu_ms_per_op:.2f} / {floor.cpu_ms_per_op:.2f}" if fresh and floor else "-",
        )
    console.print(t)
    console.print(
        "  +ms/op: extra wall time per operation of execute() over the floor.\n"
        "  floor: plain psycopg 3 in autocommit, a connection per thread, narrow scratch table; "
        "per operation INSERT .. ON CONFLICT DO NOTHING\n"
        "    RETURNING id, version (one round trip, its own commit), then the version-fenced "
        "UPDATE .. RETURNING version (one round trip, its own commit).\n"
        "  same SQL: the two statements one execute() sends (the claim, its event on the row; "
        "the fenced update, its event on the row), captured at the\n"
        "    psycopg cursor and run in plain psycopg (autocommit, a connection per thread) on "
        "payorch's tables, fresh ids and keys per operation.\n"
        "  no pre-ping: execute() on an engine created with pool_pre_ping=False explicitly "
        "(payorch's default engine no longer pings either: the two arms should match).\n"
        "  CPU ms/op e / f: client process CPU (time.process_time) per operation, execute() / "
        "floor; includes the in-process provider."
    )
    _print_dbos(console, report, opts)
    t = table(
        "PostgreSQL: replays, execute() of a key that already succeeded (ops/s; p50 / p99 ms)",
        (
            "threads",
            "one-statement floor",
            "p50 / p99",
            "replay",
            "p50 / p99 ",
            "replay/floor",
            "per round",
            "replay/execute",
        ),
        bold=("replay/floor",),
    )
    for n in opts.threads:
        floor = report.result("postgres", n, "floor_replay")
        replay = report.result("postgres", n, "execute_replay")
        fresh = report.result("postgres", n, "execute")
        t.add_row(
            str(n),
            ops(floor),
            lat(floor),
            ops(replay),
            lat(replay),
            ratio(replay, floor),
            ratio_range(report, "postgres", n, "execute_replay", "floor_replay"),
            ratio(replay, fresh),
        )
    console.print(t)
    console.print(
        "  one-statement floor: in autocommit, one round trip: a CTE whose INSERT .. ON "
        "CONFLICT DO NOTHING finds the key taken and whose SELECT reads the row."
    )


def _print_dbos(console: Console, report: Report, opts: Options) -> None:
    if not any(report.result("postgres", n, "dbos") for n in opts.threads):
        if "dbos" in report.extra:
            console.print(str(report.extra["dbos"]), highlight=False, markup=False)
        return
    t = table(
        "PostgreSQL: execute() vs a DBOS workflow with one step (the same instant provider), "
        "same server, same rounds (ops/s; p50 / p99 ms)",
        (
            "threads",
            "DBOS",
            "p50 / p99",
            "execute()",
            "execute/DBOS",
            "per round",
            "DBOS/floor",
            "CPU ms/op d / e",
        ),
        bold=("execute/DBOS",),
    )
    for n in opts.threads:
        dbos = report.result("postgres", n, "dbos")
        fresh = report.result("postgres", n, "execute")
        t.add_row(
            str(n),
            ops(dbos),
            lat(dbos),
            ops(fresh),
            ratio(fresh, dbos),
            ratio_range(report, "postgres", n, "execute", "dbos"),
            ratio(dbos, report.result("postgres", n, "floor")),
            f"{dbos.cpu_ms_per_op:.2f} / {fresh.cpu_ms_per_op:.2f}" if dbos and fresh else "-",
        )
    console.print(t)
    console.print(
        "  DBOS: per operation a @DBOS.workflow whose id is the operation's namespace "
        "(SetWorkflowID), its one @DBOS.step calling the instant provider;\n"
        "    DBOS's system database on the same server, created at launch and dropped after."
    )


def _print_async(console: Console, report: Report) -> None:
    t = table(
        "execute() vs AsyncExecutor.execute() (instant provider): N threads vs N concurrent "
        "tasks on one event loop (ops/s; p50 / p99 ms)",
        ("store", "N", "sync", "p50 / p99", "async", "p50 / p99 ", "async/sync", "per round"),
        bold=("async/sync",),
    )
    for section in ("postgres", "sqlite"):
        for n in sorted(report.sections.get(section, {})):
            sync = report.result(section, n, "execute")
            aio = report.result(section, n, "execute_async")
            if aio is None:
                continue
            t.add_row(
                section,
                str(n),
                ops(sync),
                lat(sync),
                ops(aio),
                lat(aio),
                ratio(aio, sync),
                ratio_range(report, section, n, "execute_async", "execute"),
            )
    console.print(t)
    console.print(
        "  async: the sync flow run under SQLAlchemy's greenlet bridge on an async engine "
        "(psycopg async / aiosqlite); one thread, N tasks."
    )


def _print_sandbox(console: Console, report: Report) -> None:
    t = table(
        "PostgreSQL: execute() through the sandbox acquirer over loopback HTTP, server in this "
        "process (ops/s; p50 / p99 ms)",
        ("threads", "instant", "p50 / p99", "sandbox HTTP", "p50 / p99 ", "HTTP/instant"),
        bold=("HTTP/instant",),
    )
    for n in sorted(report.sections.get("sandbox", {})):
        instant = report.result("sandbox", n, "execute")
        http = report.result("sandbox", n, "execute_http")
        t.add_row(str(n), ops(instant), lat(instant), ops(http), lat(http), ratio(http, instant))
    console.print(t)


def _print_sqlite(console: Console, report: Report) -> None:
    t = table(
        "SQLite (temporary file, WAL, synchronous=NORMAL): execute() vs the raw two-commit "
        "sqlite3 floor (ops/s; p50 / p99 ms)",
        (
            "threads",
            "floor",
            "p50 / p99",
            "execute()",
            "p50 / p99 ",
            "execute/floor",
            "per round",
            "replay",
            "PG/SQLite execute()",
        ),
        bold=("execute/floor",),
    )
    for n in sorted(report.sections.get("sqlite", {})):
        floor = report.result("sqlite", n, "floor")
        fresh = report.result("sqlite", n, "execute")
        t.add_row(
            str(n),
            ops(floor),
            lat(floor),
            ops(fresh),
            lat(fresh),
            ratio(fresh, floor),
            ratio_range(report, "sqlite", n, "execute", "floor"),
            ops(report.result("sqlite", n, "execute_replay")),
            ratio(report.result("postgres", n, "execute"), fresh),
        )
    console.print(t)


def _print_scan(console: Console, report: Report) -> None:
    t = table(
        f"PostgreSQL: reconciler scan, Store.claim_due(limit={bench_scan.BATCH}) with "
        f"{report.scan[0].due} due outcome_unknown operations",
        (
            "terminal ops",
            "heap pages",
            "table+idx MB",
            "active idx kB",
            "active idx used",
            "buffers",
            "EXPLAIN ms",
            "scan p50 ms",
            "claim_due p50 / p90 ms",
            "two-step p50 ms",
            "claimed",
            "buffers after churn",
        ),
        bold=("buffers",),
    )
    for s in report.scan:
        t.add_row(
            f"{s.terminal:,}",
            f"{s.heap_pages:,}",
            f"{s.total_mb:.1f}",
            f"{s.active_index_kb:.0f}",
            "yes" if s.uses_active_index else "[red]NO",
            f"{s.shared_hit + s.shared_read}",
            f"{s.explain_ms:.3f}",
            f"{s.pick_p50_ms:.2f}",
            f"{s.claim_p50_ms:.1f} / {s.claim_p90_ms:.1f}",
            f"{s.two_step_p50_ms:.1f}",
            f"{s.claimed_per_call:.0f}",
            f"{s.churn_buffers}",
        )
    console.print(t)
    first, last = report.scan[0], report.scan[-1]
    if first.terminal and len(report.scan) > 1:
        console.print(
            f"  table x{last.terminal / first.terminal:.0f} "
            f"({first.terminal:,} -> {last.terminal:,} terminal operations): scan buffers "
            f"{first.shared_hit + first.shared_read} -> {last.shared_hit + last.shared_read}, "
            f"scan time x{last.pick_p50_ms / max(first.pick_p50_ms, 1e-9):.2f}, "
            f"claim_due time x{last.claim_p50_ms / max(first.claim_p50_ms, 1e-9):.2f}."
        )
    per_row = last.claim_p50_ms / max(last.claimed_per_call, 1)
    console.print(
        "  two-step: the pick a distributed (Citus) schema uses, on this one node: a read "
        "that locks nothing, then a lease per tenant (20 tenants here).\n"
        "  buffers: shared blocks hit+read by the scan (EXPLAIN ANALYZE, BUFFERS) right after "
        "VACUUM; after churn: the same after the claim_due repetitions, before any VACUUM.\n"
        "  scan: the statement claim_due sends on PostgreSQL (UPDATE .. FROM (SELECT .. FOR "
        "UPDATE SKIP LOCKED LIMIT 50) RETURNING: pick and lease), rolled back.\n"
        "  claim_due: the same statement committed, through the store "
        f"(~{per_row:.2f} ms per claimed operation at the largest size)."
    )
    console.print(f"  plan: {last.plan_chain}")
    console.print(f"  EXPLAIN (ANALYZE, BUFFERS) at {last.terminal:,} terminal operations:")
    for line in last.plan_text:
        console.print(f"    {line}", markup=False, highlight=False)


def print_report(console: Console, report: Report, opts: Options) -> None:
    _print_header(console, report, opts)
    if "postgres" in report.sections:
        _print_postgres(console, report, opts)
    if "sandbox" in report.sections:
        _print_sandbox(console, report)
    print_metrics(console, report)
    print_tracing(console, report)
    if "sqlite" in report.sections:
        _print_sqlite(console, report)
    _print_async(console, report)
    print_async_http(console, report)
    if report.scan:
        _print_scan(console, report)
    for section, by_threads in report.sections.items():
        for n, comparison in by_threads.items():
            for arm, r in comparison.merged.items():
                if r.unexpected:
                    console.print(
                        f"[yellow]note: {section} {arm} at {n} thread(s): {r.unexpected} of "
                        f"{r.ops} operations did not come out as expected"
                    )
    console.print(f"total wall time {report.elapsed_s:.0f}s")


# -- main --------------------------------------------------------------------------------------
