"""payorch benchmarks: ``execute()`` against a raw two-commit floor, and the reconciler's scan
cost against table size. Prints figures and ratios; asserts nothing.

    .venv/bin/python benchmarks/run.py            # what `make bench` runs (under 2 minutes)
    .venv/bin/python benchmarks/run.py --quick    # smaller counts, a smoke run

PostgreSQL comes from $PAYORCH_BENCH_DATABASE_URL or a throwaway cluster started with
tests/pgcluster.py (stopped and deleted at the end); every database the run creates is
dropped again. SQLite runs in a temporary directory. Everything is on loopback. See
docs/benchmarks.md for what each figure means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_db
import bench_execute as bx
import bench_scan

from orchestrator import migrate
from orchestrator.executor import Executor
from orchestrator.operations import default_registry
from orchestrator.store import Store

TENANT = "bench-shop"
DEFAULT_SIZES = "10000,100000,300000"
Say = Callable[[str], None]


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


# -- the measurements --------------------------------------------------------------------------


def instant_executor(store: Store, owner: str) -> Executor:
    return Executor(
        store=store,
        providers=[bx.InstantProvider()],
        registry=default_registry(provider="instant"),
        lease=timedelta(seconds=30),
        owner=owner,
    )


def bench_postgres(db: bench_db.Database, opts: Options, report: Report, say: Say) -> None:
    """execute() with the instant provider, the raw floor and payorch's SQL hand-written,
    interleaved; then (optionally) execute() through the sandbox over loopback HTTP."""
    bx.prepare_pg_floors(db.conninfo)
    store = Store.from_url(db.url)
    executor = instant_executor(store, "bench-executor")
    # The same, on an engine without payorch's default pool_pre_ping (a SELECT 1 per checkout).
    unpinged = Store.from_url(db.url, pool_pre_ping=False)
    executor_unpinged = instant_executor(unpinged, "bench-executor-noping")
    arms = [
        bx.Arm(
            name="floor",
            fresh=bx.pg_floor_workload(db.conninfo, TENANT),
            replay=bx.pg_replay_floor_workload(db.conninfo, TENANT),
        ),
        bx.Arm(name="shaped", fresh=bx.pg_shaped_workload(db.conninfo, TENANT)),
        bx.Arm(
            name="execute",
            fresh=bx.execute_workload(executor, TENANT),
            replay=bx.replay_workload(executor, TENANT),
        ),
        bx.Arm(name="execute_noping", fresh=bx.execute_workload(executor_unpinged, TENANT)),
    ]
    try:
        for n in opts.threads:
            say(f"PostgreSQL, {n} thread(s): floors, execute() (two engines), replays, interleaved")
            report.add(
                "postgres",
                n,
                bx.interleave(
                    arms,
                    threads=n,
                    total=opts.pg_ops(n),
                    replays=opts.replay_ops,
                    rounds=opts.rounds,
                    warmup=opts.warmup,
                ),
            )
        if opts.sandbox:
            bench_sandbox(store, executor, opts, report, say)
    finally:
        store.close()
        unpinged.close()


def bench_sandbox(store: Store, instant: Executor, opts: Options, report: Report, say: Say) -> None:
    from providers.sandbox import SandboxProvider, SandboxServer

    with (
        SandboxServer() as server,
        SandboxProvider(base_url=server.url, webhook_secret=server.webhook_secret) as sandbox,
    ):
        http = Executor(
            store=store,
            providers=[sandbox],
            registry=default_registry(provider="sandbox"),
            lease=timedelta(seconds=120),
            owner="bench-executor-http",
        )
        arms = [
            bx.Arm(name="execute", fresh=bx.execute_workload(instant, TENANT + "-i")),
            bx.Arm(name="execute_http", fresh=bx.execute_workload(http, TENANT + "-h")),
        ]
        for n in (1, 4) if 4 in opts.threads else (1,):
            say(f"PostgreSQL, {n} thread(s): execute() via the sandbox over HTTP vs instant")
            report.add(
                "sandbox",
                n,
                bx.interleave(
                    arms,
                    threads=n,
                    total=opts.http_ops,
                    replays=0,
                    rounds=opts.rounds,
                    warmup=min(opts.warmup, 20),
                ),
            )


def bench_sqlite(opts: Options, report: Report, say: Say) -> None:
    with tempfile.TemporaryDirectory(prefix="payorch-bench-") as tmp:
        path = str(Path(tmp) / "bench.db")
        url = f"sqlite:///{path}"
        migrate.upgrade(url)
        bx.prepare_sqlite_floor(path)
        store = Store.from_url(url)
        executor = instant_executor(store, "bench-executor-sqlite")
        arms = [
            bx.Arm(name="floor", fresh=bx.sqlite_floor_workload(path, TENANT)),
            bx.Arm(
                name="execute",
                fresh=bx.execute_workload(executor, TENANT),
                replay=bx.replay_workload(executor, TENANT),
            ),
        ]
        try:
            for n in sorted({1, min(4, max(opts.threads))}):
                say(f"SQLite, {n} thread(s): floor, execute() and replays, interleaved")
                report.add(
                    "sqlite",
                    n,
                    bx.interleave(
                        arms,
                        threads=n,
                        total=opts.sqlite_ops,
                        replays=opts.replay_ops,
                        rounds=opts.rounds,
                        warmup=opts.warmup,
                    ),
                )
        finally:
            store.close()


# -- the report --------------------------------------------------------------------------------


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
            f"full_page_writes={env['full_page_writes']}[/] shared_buffers={env['shared_buffers']}"
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
        )
    console.print(t)
    console.print(
        "  +ms/op: extra wall time per operation of execute() over the floor.\n"
        "  floor: per operation INSERT .. ON CONFLICT DO NOTHING RETURNING + commit, then "
        "UPDATE + commit; plain psycopg 3, narrow scratch table.\n"
        "  same SQL: payorch's own statements (claim + event; fenced update + event + "
        "NOTIFY) hand-written in psycopg on copies of its tables.\n"
        "  no pre-ping: execute() on an engine created with pool_pre_ping=False (payorch's "
        "default engine pings on every pool checkout, two checkouts per operation)."
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
        "  scan: the SELECT .. FOR UPDATE SKIP LOCKED that claim_due sends, alone, rolled "
        "back. claim_due: that scan, one fenced lease UPDATE .. RETURNING\n"
        f"  per claimed operation and the commit (~{per_row:.2f} ms per claimed operation at "
        "the largest size)."
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
    if "sqlite" in report.sections:
        _print_sqlite(console, report)
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


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: Sequence[str] | None) -> Options:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ops", type=int, default=1500, help="PostgreSQL ops, single-threaded")
    p.add_argument("--threaded-ops", type=int, default=600, help="PostgreSQL ops, N threads")
    p.add_argument("--sqlite-ops", type=int, default=600, help="SQLite ops per configuration")
    p.add_argument("--replay-ops", type=int, default=500, help="replays per configuration")
    p.add_argument("--http-ops", type=int, default=250, help="ops through the sandbox")
    p.add_argument("--threads", default="1,4,16", help="thread counts (default 1,4,16)")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds per configuration")
    p.add_argument("--warmup", type=int, default=50, help="untimed ops per workload first")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="terminal operations, steps ('' skips)")
    p.add_argument("--due", type=int, default=200, help="due outcome_unknown operations")
    p.add_argument("--no-sqlite", action="store_true", help="skip the SQLite comparison")
    p.add_argument("--no-sandbox", action="store_true", help="skip the loopback HTTP run")
    p.add_argument("--quick", action="store_true", help="small counts: a smoke run")
    p.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    a = p.parse_args(argv)
    if a.quick:
        a.ops, a.threaded_ops, a.sqlite_ops, a.replay_ops, a.http_ops = 300, 200, 200, 100, 60
        a.warmup, a.rounds = 10, 2
        if a.sizes == DEFAULT_SIZES:
            a.sizes = "5000,20000"
    return Options(
        ops=max(1, a.ops),
        threaded_ops=max(1, a.threaded_ops),
        sqlite_ops=max(1, a.sqlite_ops),
        replay_ops=max(0, a.replay_ops),
        http_ops=max(1, a.http_ops),
        threads=_ints(a.threads) or (1,),
        rounds=max(1, a.rounds),
        warmup=max(0, a.warmup),
        sizes=_ints(a.sizes),
        due=max(bench_scan.BATCH, a.due),
        pick_reps=10 if a.quick else 30,
        claim_reps=5 if a.quick else 15,
        sqlite=not a.no_sqlite,
        sandbox=not a.no_sandbox,
        json_path=a.json,
    )


def _load() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def environment() -> dict[str, str]:
    import psycopg
    import sqlalchemy

    return {
        "cpus": str(os.cpu_count()),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "sqlalchemy": sqlalchemy.__version__,
        "psycopg": psycopg.__version__,
        "sqlite": sqlite3.sqlite_version,
        "load_before": _load(),
    }


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds the finally blocks: the cluster is stopped


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    console = Console(width=None if sys.stdout.isatty() else 170, soft_wrap=True)
    started = time.perf_counter()

    def say(message: str) -> None:
        console.print(f"[dim]{time.perf_counter() - started:6.1f}s  {message}", highlight=False)

    report = Report(environment=environment())
    say("starting PostgreSQL")
    with bench_db.postgres_server() as server:
        settings = bench_db.server_settings(bench_db.conninfo_of(server.url))
        report.environment.update(
            pg_version=settings["server_version"],
            pg_origin=server.origin,
            fsync=settings["fsync"],
            synchronous_commit=settings["synchronous_commit"],
            full_page_writes=settings["full_page_writes"],
            shared_buffers=settings["shared_buffers"],
        )
        with bench_db.fresh_database(server, "payorch_bench_exec") as db:
            bench_postgres(db, opts, report, say)
        if opts.sizes:
            with bench_db.fresh_database(server, "payorch_bench_scan") as db:
                report.scan = bench_scan.run_scan(
                    db.url,
                    db.conninfo,
                    opts.sizes,
                    due=opts.due,
                    pick_reps=opts.pick_reps,
                    claim_reps=opts.claim_reps,
                    progress=say,
                )
        say("done with PostgreSQL")
    if opts.sqlite:
        bench_sqlite(opts, report, say)
    report.elapsed_s = time.perf_counter() - started
    report.environment["load_after"] = _load()
    print_report(console, report, opts)
    if opts.json_path is not None:
        opts.json_path.write_text(json.dumps(report.summary(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
