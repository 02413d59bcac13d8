"""What OpenTelemetry tracing costs ``execute()``: the same executor with tracing on and off.

"On" is an SDK ``TracerProvider`` with a batch span processor and an exporter that drops
what it is given (the spans are created, timed, attributed and queued, as in production,
minus the network); "off" is what a process without an SDK gets: no tracer provider, so
payorch's helpers are no-ops. Both arms run the instant in-process provider on PostgreSQL,
interleaved like every other comparison; each arm switches payorch's provider for its own
rounds only (:func:`payorch.tracing.use_tracer_provider`).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import bench_execute as bx
from figures import Options, Report, lat, ops, ratio_range, table
from rich.console import Console

from payorch import Executor
from payorch.core import State
from payorch.observing import _tracing as tracing
from payorch.provider import Answer, AnswerKind, SubmitRequest

__all__ = ["SECTION", "bench_tracing", "print_tracing"]

SECTION = "tracing"


def sdk_provider() -> Any | None:
    """An SDK provider exporting nowhere, or None without ``opentelemetry-sdk``."""
    if importlib.util.find_spec("opentelemetry.sdk") is None:
        return None
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class Discard(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    return provider


def span_cost(provider: Any | None, loops: int = 5_000) -> float:
    """Seconds of the tracing work of one fresh ``execute()`` (its four spans, their
    attributes and the traceparent header), timed alone in a loop; ``provider`` None: off."""
    request = SubmitRequest(
        tenant_id="t",
        operation="payment.create",
        operation_id="op",
        downstream_key="dk",
        payload={},
    )
    answer = Answer(kind=AnswerKind.SUCCEEDED, status_code=200)
    before = SimpleNamespace(id="op", state=State.IN_PROGRESS)
    outcome = SimpleNamespace(
        operation_id="op", state=State.SUCCEEDED, replayed=False, needs_attention=False
    )

    @tracing.instrumented_execute
    def execute(**_: Any) -> Any:
        with tracing.claim("bench") as span:
            tracing.set_attributes(span, created=True, replayed=False)
        with tracing.attempt("bench", request, 1) as span:
            tracing.inject({"Idempotency-Key": "dk"})
            tracing.answered(span, answer)
        with tracing.record(before, State.SUCCEEDED, "provider_answer"):  # type: ignore[arg-type]
            pass
        return outcome

    tracing.use_tracer_provider(provider)
    try:
        started = time.perf_counter()
        for _ in range(loops):
            execute(tenant_id="t", operation="payment.create", provider="bench")
        return (time.perf_counter() - started) / loops
    finally:
        tracing.use_tracer_provider(None)


def _with(
    provider: Any | None, fresh: Callable[[str], bx.Factory]
) -> Callable[[int, int, str], bx.RunResult]:
    def runner(threads: int, total: int, prefix: str) -> bx.RunResult:
        tracing.use_tracer_provider(provider)
        try:
            return bx.run_threads(threads, total, fresh(prefix))
        finally:
            tracing.use_tracer_provider(None)

    return runner


def bench_tracing(
    executor: Executor, tenant: str, opts: Options, report: Report, say: Callable[[str], None]
) -> None:
    provider = sdk_provider()
    if provider is None:
        say("tracing: opentelemetry-sdk is not installed, nothing to compare")
        return
    report.environment["tracing_spans_us_on"] = f"{span_cost(provider) * 1e6:.2f}"
    report.environment["tracing_spans_us_off"] = f"{span_cost(None) * 1e6:.2f}"
    fresh = bx.execute_workload(executor, tenant)
    arms = [
        bx.Arm(name="tracing_on", fresh=fresh, runner=_with(provider, fresh)),
        bx.Arm(name="tracing_off", fresh=fresh, runner=_with(None, fresh)),
    ]
    try:
        for n in sorted({1, min(4, max(opts.threads))}):
            say(f"PostgreSQL, {n} thread(s): execute() with tracing on and off, interleaved")
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
    finally:
        provider.shutdown()


def print_tracing(console: Console, report: Report) -> None:
    by_threads = report.sections.get(SECTION)
    if not by_threads:
        return
    t = table(
        "PostgreSQL: execute() with OpenTelemetry tracing on (SDK, batch processor, discarding "
        "exporter) and off (no SDK) (instant provider; ops/s, p50 / p99 ms)",
        (
            "threads",
            "tracing on",
            "p50 / p99",
            "tracing off",
            "p50 / p99 ",
            "on/off",
            "per round",
            "cost µs/op",
        ),
        bold=("on/off",),
    )
    for n in sorted(by_threads):
        on = report.result(SECTION, n, "tracing_on")
        off = report.result(SECTION, n, "tracing_off")
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
            ratio_range(report, SECTION, n, "tracing_on", "tracing_off"),
            cost,
        )
    console.print(t)
    on_us = report.environment.get("tracing_spans_us_on", "-")
    off_us = report.environment.get("tracing_spans_us_off", "-")
    console.print(
        "  The tracing work of one fresh execute(), timed alone in a loop: "
        f"{on_us} µs with the SDK, {off_us} µs without.\n"
        "  Four spans per fresh execute() (execute, claim, submit, record; a replay has "
        "two). cost µs/op: extra client time per operation with tracing on (from "
        "throughput, times the threads); within the noise when the per-round range spans 1.00."
    )
