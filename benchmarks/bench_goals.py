"""The secondary fsync=off table and the issue-13 goals (printed by run.py, never asserted)."""

from __future__ import annotations

import bench_drain
import bench_storm
from figures import Options, Report
from rich.console import Console

__all__ = ["print_fsync_off", "print_goals"]


def print_fsync_off(console: Console, report: Report, opts: Options) -> None:
    from rich.table import Table

    if "fsync_off" not in report.sections:
        return
    t = Table(
        title="Secondary: the same on a cluster with "
        f"{report.environment.get('fsync_off_settings', 'fsync=off')} (commits do not wait "
        "for the disk; flatters both arms)",
        title_justify="left",
    )
    for col in ("threads", "floor ops/s", "execute() ops/s", "execute/floor", "CPU ms/op e / f"):
        t.add_column(col, justify="right")
    for n in opts.threads:
        floor = report.result("fsync_off", n, "floor")
        fresh = report.result("fsync_off", n, "execute")
        if floor is None or fresh is None:
            continue
        t.add_row(
            str(n),
            f"{floor.ops_per_s:,.0f}",
            f"{fresh.ops_per_s:,.0f}",
            f"{fresh.ops_per_s / floor.ops_per_s:.2f}" if floor.ops_per_s else "-",
            f"{fresh.cpu_ms_per_op:.2f} / {floor.cpu_ms_per_op:.2f}",
        )
    console.print(t)


def print_goals(
    console: Console,
    report: Report,
    opts: Options,
    storm: list[bench_storm.StormResult],
    drained: list[bench_drain.DrainResult],
) -> None:
    """The issue's goals against this run's figures (printed, never asserted)."""
    lines: list[str] = []

    def goal(text: str, met: bool | None) -> None:
        mark = "n/a" if met is None else ("met" if met else "NOT met")
        lines.append(f"  {mark:>7}: {text}")

    top = max(opts.threads)
    floor, fresh = (
        report.result("postgres", top, "floor"),
        report.result("postgres", top, "execute"),
    )
    if floor and fresh and floor.ops_per_s:
        ratio = fresh.ops_per_s / floor.ops_per_s
        text = f"execute() >= 0.6x floor at 8 threads (durable): {ratio:.2f}x at {top}"
        goal(text, ratio >= 0.6 if top >= 8 else None)  # the goal is stated at 8 threads
    for n in opts.threads:
        r = report.result("postgres", n, "execute")
        if r:
            ms = r.cpu_ms_per_op
            base = report.result("postgres", n, "floor")
            of_floor = f" (the floor's: {base.cpu_ms_per_op:.2f} ms)" if base else ""
            goal(
                f"client CPU per execute() <= 1 ms ({n} thread(s)): {ms:.2f} ms{of_floor}",
                ms <= 1.0,
            )
    for s in storm:
        if s.loser_lag_ms:
            p99 = bench_storm.StormResult.pct(s.loser_lag_ms, 0.99)
            text = f"storm losers p99 lag <= {s.goal_ms:.0f} ms (executors {s.executors})"
            goal(f"{text}: {p99:.1f} ms", p99 <= s.goal_ms)
    floors = {d.daemons: d for d in drained if d.floor}
    for d in drained:
        if d.floor:
            continue
        limit = 60.0 if d.daemons == 1 else 20.0
        full = d.operations >= 10000
        bound = ""
        if d.cpu_bound_s is not None:
            bound = f"; the CPU allows no less than {d.cpu_bound_s:.1f} s"
        if (floor := floors.get(d.daemons)) is not None and floor.settled == floor.operations:
            bound += f"; the bare floor took {floor.seconds:.1f} s"
        goal(
            f"drain {d.operations} ops, {d.daemons} daemon(s): {d.seconds:.1f} s "
            f"(goal at 10,000: <= {limit:.0f} s{'' if full else '; not the full count'}{bound})",
            (d.seconds <= limit and d.double_checked == 0) if full else None,
        )
        goal(
            f"daemon peak RSS <= 100 MB ({d.daemons} daemon(s)): {d.max_rss_mb:.0f} MB",
            d.max_rss_mb <= 100,
        )
    console.print("[bold]Goals (from issue 13; printed, not asserted)")
    console.print("\n".join(lines), highlight=False)
