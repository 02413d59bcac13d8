"""The secondary fsync=off table and the goals of issues 36 and 13 (printed by run.py, never
asserted)."""

from __future__ import annotations

from collections.abc import Callable

import bench_async_http
import bench_drain
import bench_fresh
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
    """The goals of issue 36 (lean writes), then issue 13's storm and drain goals, against
    this run's figures (printed, never asserted)."""
    lines: list[str] = []

    def goal(text: str, met: bool | None) -> None:
        mark = "n/a" if met is None else ("met" if met else "NOT met")
        lines.append(f"  {mark:>7}: {text}")

    _issue_36(report, opts, goal)
    _lean_writes(report, goal)
    console.print("[bold]Goals (from issue 36; printed, not asserted)")
    console.print("\n".join(lines), highlight=False, markup=False)
    lines.clear()
    _issue_13(storm, drained, goal)
    if lines:
        console.print("[bold]Goals (from issue 13: the storm and the drain)")
        console.print("\n".join(lines), highlight=False, markup=False)


def _issue_36(report: Report, opts: Options, goal: Callable[[str, bool | None], None]) -> None:
    for n in opts.threads:
        fresh = report.result("postgres", n, "execute")
        floor = report.result("postgres", n, "floor")
        stated = n in (1, 8)  # the goal names 1 and 8 threads
        if fresh and floor and floor.ops_per_s:
            x = fresh.ops_per_s / floor.ops_per_s
            goal(
                f"execute() >= 0.8x the floor ({n} thread(s), same run): {x:.2f}x "
                f"(CPU ms/op {fresh.cpu_ms_per_op:.2f} vs {floor.cpu_ms_per_op:.2f})",
                x >= 0.8 if stated else None,
            )
    for n in opts.threads:
        fresh = report.result("postgres", n, "execute")
        dbos = report.result("postgres", n, "dbos")
        if dbos is None:
            why = report.extra.get("dbos", "DBOS: did not run")
            goal(f"execute() >= 6x DBOS workflow + step ({n} thread(s)): {why}", None)
        elif fresh and dbos.ops_per_s:
            x = fresh.ops_per_s / dbos.ops_per_s
            goal(f"execute() >= 6x DBOS workflow + step ({n} thread(s)): {x:.2f}x", x >= 6.0)
    section = bench_async_http.SECTION
    for n in sorted(report.sections.get(section, {})):
        mine = report.result(section, n, "payorch")
        floor = report.result(section, n, "floor")
        stated = n in (64, 256)
        if mine and floor and floor.ops_per_s:
            x = mine.ops_per_s / floor.ops_per_s
            goal(
                f"AsyncExecutor >= 0.8x the async floor ({n} in flight): {x:.2f}x "
                f"({mine.ops_per_s:,.0f} vs {floor.ops_per_s:,.0f} ops/s)",
                x >= 0.8 if stated else None,
            )
    for n in sorted(report.sections.get(section, {})):
        kb = bench_async_http.memory_kb(report, "payorch", n)
        if kb is not None:
            text = f"memory per AsyncExecutor operation in flight <= 50 KB ({n}): {kb:.1f} KB"
            goal(text, kb <= 50)
    if not report.sections.get(section):
        goal("AsyncExecutor >= 0.8x the async floor; memory <= 50 KB: not run", None)


def _lean_writes(report: Report, goal: Callable[[str, bool | None], None]) -> None:
    fresh_runs = [bench_fresh.FreshResult(**r) for r in report.extra.get("fresh", [])]
    x = bench_fresh.fresh_ratio(fresh_runs)
    if x is None:
        goal("a fresh database within 10% of an analyzed one: not run", None)
    else:
        ops = fresh_runs[0].ops
        goal(
            f"a fresh, never-analyzed database within 10% of an analyzed one "
            f"({ops:,} operations of one tenant): {x:.2f}x",
            x >= 0.9 if ops >= 10000 else None,
        )
    wal = {r["arm"]: r for r in report.extra.get("wal", [])}
    if "floor" in wal and "execute" in wal and wal["floor"]["wal_bytes"]:
        x = wal["execute"]["wal_bytes"] / wal["floor"]["wal_bytes"]
        goal(
            f"WAL bytes per fresh operation <= 2x the floor's: {x:.2f}x "
            f"({wal['execute']['wal_bytes']:,.0f} vs {wal['floor']['wal_bytes']:,.0f} B)",
            x <= 2.0,
        )
    else:
        why = report.extra.get("wal_note") or "not run"
        goal(f"WAL bytes per fresh operation <= 2x the floor's: {why}", None)


def _issue_13(
    storm: list[bench_storm.StormResult],
    drained: list[bench_drain.DrainResult],
    goal: Callable[[str, bool | None], None],
) -> None:
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
