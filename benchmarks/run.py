"""payorch benchmarks: ``execute()`` against the raw psycopg floor (one statement per phase) and
DBOS, the async path at 100 ms of provider latency against an async floor, the duplicate
storm, the backlog drain, and the reconciler's scan cost against table size. Prints figures
and ratios; asserts nothing.

    .venv/bin/python benchmarks/run.py            # what `make bench` runs (~7 minutes)
    .venv/bin/python benchmarks/run.py --quick    # smaller counts (~2.5 minutes)

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
from datetime import timedelta
from pathlib import Path
from types import FrameType

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_async_http
import bench_breakdown
import bench_citus
import bench_db
import bench_dbos
import bench_drain
import bench_execute as bx
import bench_floors as bf
import bench_fresh
import bench_goals
import bench_metrics
import bench_scan
import bench_storm
import bench_tracing
import bench_wal
from bench_async import AsyncBench
from figures import Options, Report
from report import print_report

from payorch import Executor, Store, migrate
from payorch.operations import default_registry

TENANT = "bench-shop"
DEFAULT_SIZES = "10000,100000,300000"
DRAIN: tuple[int, tuple[int, ...], int] = (10000, (1, 4), 32)  # operations, daemons, concurrency
EXTRA: tuple[int, bool] = (10, True)  # duplicate storms, run the fsync=off secondary
Say = Callable[[str], None]


# -- the measurements --------------------------------------------------------------------------


def instant_executor(store: Store, owner: str) -> Executor:
    return Executor(
        store=store,
        providers=[bx.InstantProvider()],
        registry=default_registry(provider="instant"),
        lease=timedelta(seconds=30),
        owner=owner,
    )


def bench_postgres(
    server: bench_db.Server, db: bench_db.Database, opts: Options, report: Report, say: Say
) -> None:
    """execute() with the instant provider, the raw floor, payorch's SQL driven by hand and
    DBOS, interleaved; then (optionally) execute() through the sandbox over loopback HTTP."""
    bf.prepare_pg_floors(db.conninfo)
    captured, captured_key = bf.capture_execute(db.url, TENANT, "bench-executor")
    store = Store.from_url(db.url)
    executor = instant_executor(store, "bench-executor")
    # The same, on an engine without payorch's default pool_pre_ping (a SELECT 1 per checkout).
    unpinged = Store.from_url(db.url, pool_pre_ping=False)
    executor_unpinged = instant_executor(unpinged, "bench-executor-noping")
    aio = AsyncBench(db.url, tenant=TENANT, owner="bench-executor-async")
    arms = [
        bx.Arm(
            name="floor",
            fresh=bf.pg_floor_workload(db.conninfo, TENANT),
            replay=bf.pg_replay_floor_workload(db.conninfo, TENANT),
        ),
        bx.Arm(name="shaped", fresh=bf.pg_same_sql_workload(db.conninfo, captured, captured_key)),
        bx.Arm(
            name="execute",
            fresh=bx.execute_workload(executor, TENANT),
            replay=bx.replay_workload(executor, TENANT),
        ),
        bx.Arm(name="execute_noping", fresh=bx.execute_workload(executor_unpinged, TENANT)),
        # N threads for the sync arms are N concurrent tasks on one loop here.
        bx.Arm(name="execute_async", fresh=bx.execute_workload(executor, TENANT), runner=aio.run),
    ]
    dbos: bench_dbos.DbosBench | None = None
    if not opts.dbos:
        report.extra["dbos"] = "DBOS: skipped (--no-dbos)"
    elif not bench_dbos.available():
        report.extra["dbos"] = bench_dbos.NOT_INSTALLED
    else:
        say("DBOS: launching, its system database on the same server")
        try:
            dbos = bench_dbos.DbosBench(server, bx.InstantProvider())
        except Exception as exc:  # noqa: BLE001 - the run goes on without the arm, and says why
            report.extra["dbos"] = f"DBOS: could not launch ({type(exc).__name__}: {exc})"
        else:
            arms.append(bx.Arm(name="dbos", fresh=dbos.workload(TENANT)))
    try:
        for n in opts.threads:
            say(
                f"PostgreSQL, {n} thread(s): floors, same SQL, execute() (two engines), "
                f"{'DBOS, ' if dbos else ''}replays, interleaved"
            )
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
                    after_warmup=lambda: bench_db.analyze(db.conninfo),
                ),
            )
        if opts.wal_ops:
            measure_wal(db, arms, opts, report, say)
        if dbos is not None:
            dbos.close()
            dbos = None
        bench_metrics.bench_metrics(executor, TENANT + "-m", opts, report, say)
        bench_tracing.bench_tracing(executor, TENANT + "-t", opts, report, say)
        if opts.sandbox:
            bench_sandbox(store, executor, opts, report, say)
    finally:
        if dbos is not None:
            dbos.close()
        store.close()
        unpinged.close()
        aio.close()


def measure_wal(
    db: bench_db.Database, arms: list[bx.Arm], opts: Options, report: Report, say: Say
) -> None:
    """What one fresh operation writes, per arm (the floor, execute(), DBOS if it ran)."""
    meter = bench_wal.WalMeter(db.conninfo)
    if meter.unavailable:
        report.extra["wal_note"] = meter.unavailable
        return
    results = []
    for arm in arms:
        if arm.name in ("floor", "execute", "dbos"):
            say(f"WAL per operation: {arm.name}, {opts.wal_ops} operations on one thread")
            results.append(meter.measure(arm.name, arm.fresh, ops=opts.wal_ops).to_dict())
    report.extra["wal"] = results


def bench_sandbox(store: Store, instant: Executor, opts: Options, report: Report, say: Say) -> None:
    from payorch.providers.sandbox import SandboxProvider, SandboxServer

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
        aio = AsyncBench(url, tenant=TENANT, owner="bench-executor-sqlite-async")
        arms = [
            bx.Arm(name="floor", fresh=bx.sqlite_floor_workload(path, TENANT)),
            bx.Arm(
                name="execute",
                fresh=bx.execute_workload(executor, TENANT),
                replay=bx.replay_workload(executor, TENANT),
            ),
            bx.Arm(
                name="execute_async", fresh=bx.execute_workload(executor, TENANT), runner=aio.run
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
            aio.close()


def bench_fsync_off(opts: Options, report: Report, say: Say) -> None:
    """The secondary row: floor and execute() on a second, fsync=off cluster."""
    say("starting a second PostgreSQL with fsync=off (secondary row)")
    with (
        bench_db.postgres_server(durable=False, use_env=False) as server,
        bench_db.fresh_database(server, "payorch_bench_nofsync") as db,
    ):
        s = bench_db.server_settings(db.conninfo)
        report.environment["fsync_off_settings"] = (
            f"fsync={s['fsync']} synchronous_commit={s['synchronous_commit']} "
            f"full_page_writes={s['full_page_writes']}"
        )
        bf.prepare_pg_floors(db.conninfo)
        store = Store.from_url(db.url)
        arms = [
            bx.Arm(name="floor", fresh=bf.pg_floor_workload(db.conninfo, TENANT)),
            bx.Arm(
                name="execute",
                fresh=bx.execute_workload(instant_executor(store, "bench-nofsync"), TENANT),
            ),
        ]
        try:
            for n in opts.threads:
                say(f"PostgreSQL fsync=off, {n} thread(s): floor and execute(), interleaved")
                report.add(
                    "fsync_off",
                    n,
                    bx.interleave(
                        arms,
                        threads=n,
                        total=opts.pg_ops(n),
                        replays=0,
                        rounds=opts.rounds,
                        warmup=opts.warmup,
                        after_warmup=lambda: bench_db.analyze(db.conninfo),
                    ),
                )
        finally:
            store.close()


# -- command line -------------------------------------------------------------------------------


def bench_backlog(server: bench_db.Server, say: Say) -> list[bench_drain.DrainResult]:
    """Backlog drain: N due operations, status latency 100 ms, 1 and 4 daemon processes; and
    the floor with as many bare processes as the most daemons."""
    from payorch.providers.sandbox import SandboxServer

    n, daemon_counts, concurrency = DRAIN
    results: list[bench_drain.DrainResult] = []
    if n == 0:
        return results
    for daemons in daemon_counts:
        with bench_db.fresh_database(server, "payorch_bench_drain") as db, SandboxServer() as sb:
            say(f"drain: charging {n} operations with lost answers")
            bench_drain.make_backlog(db.url, sb, n)
            say(f"drain: {daemons} daemon(s), concurrency {concurrency}, status latency 100 ms")
            results.append(
                bench_drain.drain(
                    db.url, sb, daemons=daemons, n=n, concurrency=concurrency, latency=0.1
                )
            )
            if daemons == max(daemon_counts):
                say(f"drain floor: {daemons} bare process(es), the same backlog due again")
                bench_drain.make_due_again(db.url)
                results.append(
                    bench_drain.floor_drain(
                        db.url,
                        db.conninfo,
                        sb,
                        processes=daemons,
                        n=n,
                        concurrency=concurrency,
                        latency=0.1,
                    )
                )
    return results


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: Sequence[str] | None) -> Options:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ops", type=int, default=1500, help="PostgreSQL ops, single-threaded")
    p.add_argument("--threaded-ops", type=int, default=600, help="PostgreSQL ops, N threads")
    p.add_argument("--sqlite-ops", type=int, default=600, help="SQLite ops per configuration")
    p.add_argument("--replay-ops", type=int, default=500, help="replays per configuration")
    p.add_argument("--http-ops", type=int, default=250, help="ops through the sandbox")
    p.add_argument("--threads", default="1,8", help="thread counts (default 1,8)")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds per configuration")
    p.add_argument("--warmup", type=int, default=50, help="untimed ops per workload first")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="terminal operations, steps ('' skips)")
    p.add_argument("--due", type=int, default=200, help="due outcome_unknown operations")
    p.add_argument("--no-sqlite", action="store_true", help="skip the SQLite comparison")
    p.add_argument("--no-sandbox", action="store_true", help="skip the loopback HTTP run")
    p.add_argument("--drain", type=int, default=10000, help="due operations to drain (0 skips)")
    p.add_argument("--drain-daemons", default="1,4", help="daemon counts for the drain")
    p.add_argument("--drain-concurrency", type=int, default=32, help="checks at once per daemon")
    p.add_argument("--storms", type=int, default=10, help="duplicate storms of 100 (0 skips)")
    p.add_argument("--no-fsync-off", action="store_true", help="skip the fsync=off secondary run")
    p.add_argument("--no-dbos", action="store_true", help="skip the DBOS workflow arm")
    p.add_argument("--no-citus", action="store_true", help="skip the Citus row")
    p.add_argument("--async-ops", type=int, default=1000, help="async HTTP ops per arm and N")
    p.add_argument("--in-flight", default="64,256", help="async HTTP operations in flight")
    p.add_argument("--no-async-http", action="store_true", help="skip the async HTTP benchmark")
    p.add_argument(
        "--breakdown-ops", type=int, default=2000, help="ops for the CPU per phase (0 skips)"
    )
    p.add_argument(
        "--fresh-ops", type=int, default=10000, help="fresh vs analyzed, ops per arm (0 skips)"
    )
    p.add_argument("--wal-ops", type=int, default=500, help="WAL per op, ops per arm (0 skips)")
    p.add_argument("--quick", action="store_true", help="small counts: a smoke run")
    p.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    a = p.parse_args(argv)
    if a.quick:
        a.ops, a.threaded_ops, a.sqlite_ops, a.replay_ops, a.http_ops = 300, 200, 200, 100, 60
        a.async_ops = min(a.async_ops, 300)
        a.breakdown_ops = min(a.breakdown_ops, 300)
        a.fresh_ops = min(a.fresh_ops, 3000)
        a.wal_ops = min(a.wal_ops, 200)
        a.warmup, a.rounds = 10, 2
        if a.sizes == DEFAULT_SIZES:
            a.sizes = "5000,20000"
        if a.drain == 10000:
            a.drain = 1000
        a.storms = min(a.storms, 3)
    global DRAIN, EXTRA  # noqa: PLW0603 - counts set once from the command line
    DRAIN = (max(0, a.drain), _ints(a.drain_daemons) or (1,), max(1, a.drain_concurrency))
    EXTRA = (max(0, a.storms), not a.no_fsync_off)
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
        async_ops=max(1, a.async_ops),
        in_flight=_ints(a.in_flight) or (64,),
        async_http=not a.no_async_http,
        dbos=not a.no_dbos,
        citus=not a.no_citus,
        breakdown_ops=max(0, a.breakdown_ops),
        fresh_ops=max(0, a.fresh_ops),
        wal_ops=max(0, a.wal_ops),
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


def print_all(
    console: Console,
    report: Report,
    opts: Options,
    *,
    breakdown: dict[str, bench_breakdown.Breakdown],
    storm: list[bench_storm.StormResult],
    drained: list[bench_drain.DrainResult],
) -> None:
    print_report(console, report, opts)
    bench_breakdown.print_breakdown(console, breakdown)
    bench_goals.print_fsync_off(console, report, opts)
    bench_storm.print_storm(console, storm)
    bench_drain.print_drain(console, drained)
    bench_citus.print_citus(console, report)
    bench_wal.print_wal(
        console,
        [bench_wal.Amplification(**r) for r in report.extra.get("wal", [])],
        report.extra.get("wal_note"),
    )
    bench_fresh.print_fresh(
        console, [bench_fresh.FreshResult(**r) for r in report.extra.get("fresh", [])]
    )
    bench_goals.print_goals(console, report, opts, storm, drained)


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
            wal_sync_method=settings["wal_sync_method"],
            shared_buffers=settings["shared_buffers"],
        )
        with bench_db.fresh_database(server, "payorch_bench_exec") as db:
            bench_postgres(server, db, opts, report, say)
        breakdown: dict[str, bench_breakdown.Breakdown] = {}
        if opts.breakdown_ops:
            with bench_db.fresh_database(server, "payorch_bench_breakdown") as db:
                say(f"CPU per phase: {opts.breakdown_ops} operations one at a time, sync, async")
                breakdown = bench_breakdown.measure(
                    db.url,
                    ops=opts.breakdown_ops,
                    after_warmup=lambda: bench_db.analyze(db.conninfo),
                )
                report.extra["breakdown"] = bench_breakdown.summary(breakdown)
        if opts.async_http:
            with bench_db.fresh_database(server, "payorch_bench_async") as db:
                bench_async_http.run_async_http(db, opts, report, say)
        storm: list[bench_storm.StormResult] = []
        for executors in ("one", "each") if EXTRA[0] else ():
            with bench_db.fresh_database(server, "payorch_bench_storm") as db:
                say(
                    f"duplicate storm: {EXTRA[0]} x 100 identical requests, provider 50 ms, "
                    f"executors: {executors}"
                )
                storm.append(
                    bench_storm.run_storm(
                        db.url, tenant=TENANT, storms=EXTRA[0], executors=executors
                    )
                )
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
        if opts.fresh_ops:
            fresh = bench_fresh.run_fresh(server, opts.fresh_ops, TENANT, instant_executor, say)
            report.extra["fresh"] = [r.to_dict() for r in fresh]
        drained = bench_backlog(server, say)
        if opts.citus:
            bench_citus.bench_citus(server, opts, report, say, instant_executor)
        say("done with PostgreSQL")
    if EXTRA[1]:
        bench_fsync_off(opts, report, say)
    if opts.sqlite:
        bench_sqlite(opts, report, say)
    report.elapsed_s = time.perf_counter() - started
    report.environment["load_after"] = _load()
    print_all(console, report, opts, breakdown=breakdown, storm=storm, drained=drained)
    if opts.json_path is not None:
        opts.json_path.write_text(json.dumps(report.summary(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
