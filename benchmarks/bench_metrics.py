"""What Prometheus metrics cost ``execute()``: the same executor with recording on and off.

Both arms run the instant in-process provider on PostgreSQL, interleaved like every other
comparison; the off arm switches recording off process-wide for its own rounds only
(:func:`payorch.metrics.set_enabled`), so the difference is the metric updates themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import bench_execute as bx
from figures import Options, Report, lat, ops, ratio_range, table
from rich.console import Console

from payorch import Executor
from payorch.core import State
from payorch.observing import _metrics as metrics
from payorch.provider import AnswerKind

__all__ = ["SECTION", "bench_metrics", "print_metrics"]

SECTION = "metrics"


def _without_metrics(fresh: Callable[[str], bx.Factory]) -> Callable[[int, int, str], bx.RunResult]:
    def runner(threads: int, total: int, prefix: str) -> bx.RunResult:
        metrics.set_enabled(False)
        try:
            return bx.run_threads(threads, total, fresh(prefix))
        finally:
            metrics.set_enabled(True)

    return runner


def update_cost(loops: int = 20_000) -> float:
    """Seconds of the metric updates one fresh ``execute()`` makes, measured alone."""
    started = time.perf_counter()
    for _ in range(loops):
        seen = metrics.for_execution("payment.create", "bench")
        seen.claimed(0.001)
        metrics.for_provider("bench").answered("submit", AnswerKind.SUCCEEDED, 0.001)
        seen.finished("fresh", started, State.SUCCEEDED)
    return (time.perf_counter() - started) / loops


def bench_metrics(
    executor: Executor, tenant: str, opts: Options, report: Report, say: Callable[[str], None]
) -> None:
    if not metrics.AVAILABLE:
        say("metrics: prometheus_client is not installed, nothing to compare")
        return
    report.environment["metrics_update_us"] = f"{update_cost() * 1e6:.2f}"
    fresh = bx.execute_workload(executor, tenant)
    arms = [
        bx.Arm(name="metrics_on", fresh=fresh),
        bx.Arm(name="metrics_off", fresh=fresh, runner=_without_metrics(fresh)),
    ]
    for n in sorted({1, min(4, max(opts.threads))}):
        say(f"PostgreSQL, {n} thread(s): execute() with metrics on and off, interleaved")
        report.add(
            SECTION,
            n,
            bx.interleave(
                arms,
                threads=n,
                total=opts.pg_ops(n),
                replays=0,
                rounds=opts.rounds,
                warmup=opts.warmup,
            ),
        )


def print_metrics(console: Console, report: Report) -> None:
    by_threads = report.sections.get(SECTION)
    if not by_threads:
        return
    t = table(
        "PostgreSQL: execute() with Prometheus metrics on and off (instant provider; ops/s, "
        "p50 / p99 ms)",
        (
            "threads",
            "metrics on",
            "p50 / p99",
            "metrics off",
            "p50 / p99 ",
            "on/off",
            "per round",
            "cost µs/op",
        ),
        bold=("on/off",),
    )
    for n in sorted(by_threads):
        on = report.result(SECTION, n, "metrics_on")
        off = report.result(SECTION, n, "metrics_off")
        ratio = f"{on.ops_per_s / off.ops_per_s:.3f}" if on and off and off.ops_per_s else "-"
        cost = "-"
        if on and off and on.ops_per_s and off.ops_per_s:
            cost = f"{(1 / on.ops_per_s - 1 / off.ops_per_s) * 1e6 * n:+.1f}"
        t.add_row(
            str(n),
            ops(on),
            lat(on),
            ops(off),
            lat(off),
            ratio,
            ratio_range(report, SECTION, n, "metrics_on", "metrics_off"),
            cost,
        )
    console.print(t)
    alone = report.environment.get("metrics_update_us", "-")
    console.print(
        "  cost µs/op: extra client time per operation with metrics on (from throughput, times "
        "the threads); within the run's noise when the per-round range spans 1.00.\n"
        f"  The metric updates of one fresh execute(), timed alone in a loop: {alone} µs."
    )
