"""The benchmark run's figures (:class:`Report`), its options, and the cells every section
prints them with. The sections (report.py, bench_metrics.py, bench_tracing.py, …) import this
module; it imports none of them (only the result types of bench_execute and bench_scan)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import bench_execute as bx
import bench_scan
from rich.table import Table

__all__ = ["Options", "Report", "extra_ms", "lat", "ops", "ratio", "ratio_range", "table"]


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
    async_ops: int = 1000  # per arm and N in flight (bench_async_http)
    in_flight: tuple[int, ...] = (64, 256)
    async_http: bool = True
    dbos: bool = True
    citus: bool = True  # bench_citus: where the server has the extension
    breakdown_ops: int = 2000  # bench_breakdown: operations one at a time, per API
    fresh_ops: int = 10000  # bench_fresh: operations per arm (fresh, analyzed)
    wal_ops: int = 500  # bench_wal: operations per arm

    def pg_ops(self, threads: int) -> int:
        return self.ops if threads == 1 else self.threaded_ops


@dataclass
class Report:
    environment: dict[str, str] = field(default_factory=dict)
    # section ("postgres", "sandbox", "sqlite") -> threads -> the interleaved comparison
    sections: dict[str, dict[int, bx.Comparison]] = field(default_factory=dict)
    scan: list[bench_scan.ScanResult] = field(default_factory=list)
    # Figures of a section that are not RunResults (bench_async_http's memory, the sandbox
    # alone; why DBOS did not run), JSON-able as they stand.
    extra: dict[str, Any] = field(default_factory=dict)
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
                "cpu_ms_per_op": round(r.cpu_ms_per_op, 3),
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
            "extra": self.extra,
            "elapsed_s": round(self.elapsed_s, 1),
        }


def ops(r: bx.RunResult | None) -> str:
    return f"{r.ops_per_s:,.0f}" if r else "-"


def lat(r: bx.RunResult | None) -> str:
    return f"{r.p50_ms:.2f} / {r.p99_ms:.2f}" if r else "-"


def ratio(a: bx.RunResult | None, b: bx.RunResult | None) -> str:
    if a is None or b is None or b.ops_per_s == 0:
        return "-"
    return f"{a.ops_per_s / b.ops_per_s:.2f}"


def ratio_range(report: Report, section: str, threads: int, a: str, b: str) -> str:
    comparison = report.sections.get(section, {}).get(threads)
    span = comparison.ratio_range(a, b) if comparison else None
    return f"{span[0]:.2f}-{span[1]:.2f}" if span else "-"


def extra_ms(a: bx.RunResult | None, b: bx.RunResult | None) -> str:
    """Extra wall time per operation of ``a`` over ``b``, from throughput."""
    if a is None or b is None or a.ops_per_s == 0 or b.ops_per_s == 0:
        return "-"
    return f"{(1 / a.ops_per_s - 1 / b.ops_per_s) * 1000:+.2f}"


def table(title: str, columns: Sequence[str], bold: Sequence[str] = ()) -> Table:
    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col, justify="right", style="bold" if col in bold else None)
    return t
