"""The benchmark run's figures and how they are printed (the report half of run.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import bench_execute as bx
import bench_scan
from rich.console import Console
from rich.table import Table

__all__ = ["Options", "Report", "print_report"]


@dataclass(kw_only=True)
class Options:
    ops: int  # PostgreSQL, single-threaded
    threaded_ops: int  # PostgreSQL, per multi-threaded configuration
    sqlite_ops: int
    replay_ops: int
    http_ops: int
    threads: tuple[int, ...]
    rounds: int
    warmup: int
    sizes: tuple[int, ...]
    due: int
    pick_reps: int
    claim_reps: int
    sqlite: bool
    sandbox: bool
    json_path: Path | None

    def pg_ops(self, threads: int) -> int:
        return self.ops if threads == 1 else self.threaded_ops


@dataclass
class Report:
    environment: dict[str, str] = field(default_factory=dict)
    # section ("postgres", "sandbox", "sqlite") -> threads -> the interleaved comparison
    sections: dict[str, dict[int, bx.Comparison]] = field(default_factory=dict)
    scan: list[bench_scan.ScanResult] = field(default_factory=list)
    elapsed_s: float = 0.0

    def add(self, section: str, threads: int, comparison: bx.Comparison) -> None:
        self.sections.setdefault(section, {})[threads] = comparison

    def result(self, section: str, threads: int, arm: str) -> bx.RunResult | None:
        comparison = self.sections.get(section, {}).get(threads)
        return comparison.merged.get(arm) if comparison else None

    def summary(self) -> dict[str, Any]:
        """The figures as JSON-able data (no per-operation latencies)."""

        def one(r: bx.RunResult) -> dict[str, Any]:
            return {
                "ops": r.ops,
                "seconds": round(r.seconds, 3),
                "ops_per_s": round(r.ops_per_s, 1),
                "p50_ms": round(r.p50_ms, 3),
                "p99_ms": round(r.p99_ms, 3),
                "unexpected": r.unexpected,
            }

        sections = {
            name: {
                str(n): {
                    arm: {
                        **one(result),
                        "rounds_ops_per_s": [round(x.ops_per_s, 1) for x in c.rounds[arm]],
                    }
                    for arm, result in c.merged.items()
                }
                for n, c in by_threads.items()
            }
            for name, by_threads in self.sections.items()
        }
        scan = [{k: v for k, v in asdict(s).items() if k != "plan_text"} for s in self.scan]
        return {
            "environment": self.environment,
            "throughput": sections,
            "scan": scan,
            "elapsed_s": round(self.elapsed_s, 1),
        }


def _ops(r: bx.RunResult | None) -> str:
    return f"{r.ops_per_s:,.0f}" if r else "-"


def _lat(r: bx.RunResult | None) -> str:
    return f"{r.p50_ms:.2f} / {r.p99_ms:.2f}" if r else "-"


def _ratio(a: bx.RunResult | None, b: bx.RunResult | None) -> str:
    if a is None or b is None or b.ops_per_s == 0:
        return "-"
    return f"{a.ops_per_s / b.ops_per_s:.2f}"


def _range(report: Report, section: str, threads: int, a: str, b: str) -> str:
    comparison = report.sections.get(section, {}).get(threads)
    span = comparison.ratio_range(a, b) if comparison else None
    return f"{span[0]:.2f}-{span[1]:.2f}" if span else "-"


def _extra_ms(a: bx.RunResult | None, b: bx.RunResult | None) -> str:
    """Extra wall time per operation of ``a`` over ``b``, from throughput."""
    if a is None or b is None or a.ops_per_s == 0 or b.ops_per_s == 0:
        return "-"
    return f"{(1 / a.ops_per_s - 1 / b.ops_per_s) * 1000:+.2f}"


def _table(title: str, columns: Sequence[str], bold: Sequence[str] = ()) -> Table:
    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col, justify="right", style="bold" if col in bold else None)
    return t


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
        f"{opts.replay_ops:,}; HTTP {opts.http_ops:,}.\n"
        f"Each configuration runs its workloads in {opts.rounds} alternating rounds (after "
        f"{opts.warmup} untimed warm-up operations each), so drift hits them alike; the\n"
        "min-max of the per-round ratio is shown. Client threads, database server and "
        "provider share the CPUs; latencies are per operation, p50 / p99 ms."
    )


def _print_postgres(console: Console, report: Report, opts: Options) -> None:
    t = _table(
        "PostgreSQL: execute() (instant in-process provider) vs the raw two-commit psycopg floor "
        "(ops/s; p50 / p99 ms)",
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
            _ops(floor),
            _lat(floor),
            _ops(shaped),
            _ops(fresh),
            _lat(fresh),
            _ratio(fresh, floor),
            _range(report, "postgres", n, "execute", "floor"),
            _ratio(fresh, shaped),
            _extra_ms(fresh, floor),
            _ops(unpinged),
            _ratio(unpinged, floor),
            f"{fresh.cpu_ms_per_op:.2f} / {floor.cpu_ms_per_op:.2f}" if fresh and floor else "-",
        )
    console.print(t)
    console.print(
        "  +ms/op: extra wall time per operation of execute() over the floor.\n"
        "  floor: per operation INSERT .. ON CONFLICT DO NOTHING RETURNING + commit, then "
        "UPDATE + commit; plain psycopg 3, narrow scratch table.\n"
        "  same SQL: payorch's own statements (claim + event; fenced update + event + "
        "NOTIFY) hand-written in psycopg on copies of its tables.\n"
        "  no pre-ping: execute() on an engine created with pool_pre_ping=False explicitly "
        "(payorch's default engine no longer pings either: the two arms should match).\n"
        "  CPU ms/op e / f: client process CPU (time.process_time) per operation, execute() / "
        "floor; includes the in-process provider."
    )
    t = _table(
        "PostgreSQL: replays, execute() of a key that already succeeded (ops/s; p50 / p99 ms)",
        (
            "threads",
            "one-commit floor",
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
            _ops(floor),
            _lat(floor),
            _ops(replay),
            _lat(replay),
            _ratio(replay, floor),
            _range(report, "postgres", n, "execute_replay", "floor_replay"),
            _ratio(replay, fresh),
        )
    console.print(t)
    console.print(
        "  one-commit floor: the claim INSERT finds the key taken, a SELECT reads the row, commit."
    )


def _print_async(console: Console, report: Report) -> None:
    t = _table(
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
                _ops(sync),
                _lat(sync),
                _ops(aio),
                _lat(aio),
                _ratio(aio, sync),
                _range(report, section, n, "execute_async", "execute"),
            )
    console.print(t)
    console.print(
        "  async: the sync flow run under SQLAlchemy's greenlet bridge on an async engine "
        "(psycopg async / aiosqlite); one thread, N tasks."
    )


def _print_sandbox(console: Console, report: Report) -> None:
    t = _table(
        "PostgreSQL: execute() through the sandbox acquirer over loopback HTTP, server in this "
        "process (ops/s; p50 / p99 ms)",
        ("threads", "instant", "p50 / p99", "sandbox HTTP", "p50 / p99 ", "HTTP/instant"),
        bold=("HTTP/instant",),
    )
    for n in sorted(report.sections.get("sandbox", {})):
        instant = report.result("sandbox", n, "execute")
        http = report.result("sandbox", n, "execute_http")
        t.add_row(
            str(n), _ops(instant), _lat(instant), _ops(http), _lat(http), _ratio(http, instant)
        )
    console.print(t)


def _print_sqlite(console: Console, report: Report) -> None:
    t = _table(
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
            _ops(floor),
            _lat(floor),
            _ops(fresh),
            _lat(fresh),
            _ratio(fresh, floor),
            _range(report, "sqlite", n, "execute", "floor"),
            _ops(report.result("sqlite", n, "execute_replay")),
            _ratio(report.result("postgres", n, "execute"), fresh),
        )
    console.print(t)


def _print_scan(console: Console, report: Report) -> None:
    t = _table(
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
    from bench_metrics import print_metrics  # imports this module: late

    print_metrics(console, report)
    from bench_tracing import print_tracing  # imports this module: late

    print_tracing(console, report)
    if "sqlite" in report.sections:
        _print_sqlite(console, report)
    _print_async(console, report)
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
