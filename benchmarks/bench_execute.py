"""Throughput of ``Executor.execute()``: the timed loop, the interleaved rounds, the instant
provider, execute()'s workloads and SQLite's floor (PostgreSQL's floors: ``bench_floors``).

Every workload is a :data:`Factory`: called once per thread (outside the timed region, so
connections are opened before the clock starts), it returns the per-operation callable that
the timed loop runs a bounded number of times. The callable returns whether the operation
came out as expected (a fresh success, or a replay); nothing is asserted.
"""

from __future__ import annotations

import sqlite3
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from payorch import Executor
from payorch.core import State
from payorch.errors import WebhookSignatureInvalid
from payorch.provider import Answer, AnswerKind, StatusQuery, SubmitRequest, WebhookEvent
from payorch.storage._store import new_id

OPERATION = "payment.create"
REQUEST: Mapping[str, Any] = {
    "amount": 1999,
    "currency": "EUR",
    "customer": "cus_42",
    "payment_method": "pm_card_visa",
}


# -- the timed loop -----------------------------------------------------------------------


@dataclass
class Worker:
    op: Callable[[int], bool]
    close: Callable[[], None] = field(default=lambda: None)


Factory = Callable[[int], Worker]  # thread index -> that thread's worker


@dataclass(frozen=True, kw_only=True)
class RunResult:
    threads: int
    ops: int
    seconds: float
    latencies: list[float]  # seconds per operation, all threads
    unexpected: int  # operations that did not come out as the workload expected
    cpu_seconds: float = 0.0  # client process CPU (time.process_time) over the timed loop

    @property
    def cpu_ms_per_op(self) -> float:
        return self.cpu_seconds / self.ops * 1000 if self.ops else 0.0

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        if not self.latencies:
            return 0.0
        ordered = sorted(self.latencies)
        index = min(len(ordered) - 1, round(q * (len(ordered) - 1)))
        return ordered[index] * 1000

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.latencies) * 1000 if self.latencies else 0.0

    @property
    def p99_ms(self) -> float:
        return self.percentile_ms(0.99)


def split(total: int, threads: int) -> list[int]:
    """``total`` operations over ``threads`` threads, as evenly as possible."""
    base, extra = divmod(total, threads)
    return [base + (1 if t < extra else 0) for t in range(threads)]


def run_threads(threads: int, total: int, factory: Factory) -> RunResult:
    """Run ``total`` operations on ``threads`` threads; the clock covers the loop only."""
    counts = split(total, threads)
    workers = [factory(t) for t in range(threads)]
    start_line = threading.Barrier(threads + 1)
    latencies: list[list[float]] = [[] for _ in range(threads)]
    unexpected = [0] * threads
    errors: list[Exception] = []

    def body(t: int) -> None:
        worker, out = workers[t], latencies[t]
        start_line.wait()
        try:
            for i in range(counts[t]):
                began = time.perf_counter()
                ok = worker.op(i)
                out.append(time.perf_counter() - began)
                if not ok:
                    unexpected[t] += 1
        except Exception as exc:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(exc)

    pool = [
        threading.Thread(target=body, args=(t,), name=f"bench-{t}", daemon=True)
        for t in range(threads)
    ]
    for thread in pool:
        thread.start()
    start_line.wait()
    began, cpu_began = time.perf_counter(), time.process_time()
    for thread in pool:
        thread.join()
    seconds = time.perf_counter() - began
    cpu_seconds = time.process_time() - cpu_began
    for worker in workers:
        worker.close()
    if errors:
        raise errors[0]
    return RunResult(
        threads=threads,
        ops=total,
        seconds=seconds,
        latencies=[x for per in latencies for x in per],
        unexpected=sum(unexpected),
        cpu_seconds=cpu_seconds,
    )


def merge(parts: list[RunResult]) -> RunResult:
    """Several runs of one workload as one: operations and timed seconds add up."""
    return RunResult(
        threads=parts[0].threads,
        ops=sum(p.ops for p in parts),
        seconds=sum(p.seconds for p in parts),
        latencies=[x for p in parts for x in p.latencies],
        unexpected=sum(p.unexpected for p in parts),
        cpu_seconds=sum(p.cpu_seconds for p in parts),
    )


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One workload to compare; ``replay`` (optional) re-runs the keys ``fresh`` created."""

    name: str
    fresh: Callable[[str], Factory]
    replay: Callable[[str], Factory] | None = None
    # Runs (concurrency, total, key prefix) itself instead of run_threads (the async arm).
    runner: Callable[[int, int, str], RunResult] | None = None

    def run(self, threads: int, total: int, prefix: str) -> RunResult:
        if self.runner is not None:
            return self.runner(threads, total, prefix)
        return run_threads(threads, total, self.fresh(prefix))


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Per arm (and ``<arm>_replay``): the merged result and the per-round results."""

    merged: dict[str, RunResult]
    rounds: dict[str, list[RunResult]]

    def ratio_range(self, a: str, b: str) -> tuple[float, float] | None:
        """The smallest and largest per-round ``a/b`` throughput ratio."""
        ra, rb = self.rounds.get(a), self.rounds.get(b)
        if not ra or not rb:
            return None
        ratios = [x.ops_per_s / y.ops_per_s for x, y in zip(ra, rb, strict=True) if y.ops_per_s]
        return (min(ratios), max(ratios)) if ratios else None


def interleave(
    arms: list[Arm],
    *,
    threads: int,
    total: int,
    replays: int,
    rounds: int,
    warmup: int,
    after_warmup: Callable[[], None] | None = None,
) -> Comparison:
    """Run the arms in alternation, ``rounds`` times, each time ``total/rounds`` operations.

    On a shared or throttled machine throughput drifts by tens of percent over a minute;
    alternating (and rotating the order every round) exposes every arm to the same drift, so
    their ratio stays meaningful. Warm-up operations run first, untimed, per arm.
    """
    rounds = max(1, min(rounds, total))
    per_round = split(total, rounds)
    replay_per_round = split(min(replays, total), rounds)
    tag = new_id()[-8:]
    for arm in arms:
        if warmup:
            arm.run(threads, warmup, f"{arm.name}-w-t{threads}-{tag}")
    if after_warmup is not None:
        after_warmup()  # e.g. bench_db.analyze: the statistics a live database has
    collected: dict[str, list[RunResult]] = {}
    for r in range(rounds):
        order = arms[r % len(arms) :] + arms[: r % len(arms)]
        for arm in order:
            prefix = f"{arm.name}-r{r}-t{threads}-{tag}"  # arms never share a key
            collected.setdefault(arm.name, []).append(arm.run(threads, per_round[r], prefix))
            if arm.replay is not None and replay_per_round[r]:
                collected.setdefault(f"{arm.name}_replay", []).append(
                    run_threads(threads, replay_per_round[r], arm.replay(prefix))
                )
    return Comparison(
        merged={name: merge(parts) for name, parts in collected.items()}, rounds=collected
    )


def key(prefix: str, thread: int, i: int) -> str:
    return f"{prefix}-{thread}-{i}"


# -- a provider that answers at once --------------------------------------------------------


class InstantProvider:
    """Answers ``succeeded`` in-process: ``execute()`` then measures the database path."""

    def __init__(self, name: str = "instant") -> None:
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    @property
    def idempotency_window(self) -> timedelta | None:
        return timedelta(hours=24)

    @property
    def max_call_duration(self) -> timedelta:
        return timedelta(milliseconds=10)

    def submit(self, request: SubmitRequest) -> Answer:
        return Answer(kind=AnswerKind.SUCCEEDED, provider_reference=f"ref_{request.operation_id}")

    def query_status(self, query: StatusQuery) -> Answer:
        return Answer(kind=AnswerKind.SUCCEEDED, provider_reference=f"ref_{query.operation_id}")

    async def asubmit(self, request: SubmitRequest) -> Answer:
        return self.submit(request)

    async def aquery_status(self, query: StatusQuery) -> Answer:
        return self.query_status(query)

    def parse_webhook(self, headers: Mapping[str, str], body: bytes) -> WebhookEvent:
        raise WebhookSignatureInvalid("the instant provider sends no webhooks")


# -- workloads: execute() -------------------------------------------------------------------


def execute_workload(executor: Executor, tenant: str) -> Callable[[str], Factory]:
    """Fresh keys: claim, (instant) provider call, recorded outcome."""

    def factory_for(prefix: str) -> Factory:
        def factory(t: int) -> Worker:
            def op(i: int) -> bool:
                out = executor.execute(
                    tenant_id=tenant,
                    operation=OPERATION,
                    idempotency_key=key(prefix, t, i),
                    request=REQUEST,
                )
                return out.state is State.SUCCEEDED and not out.replayed

            return Worker(op)

        return factory

    return factory_for


def replay_workload(executor: Executor, tenant: str) -> Callable[[str], Factory]:
    """The keys an ``execute_workload`` run with the same prefix and thread count already
    drove to ``succeeded`` (each thread replays a prefix of its own keys)."""

    def factory_for(prefix: str) -> Factory:
        def factory(t: int) -> Worker:
            def op(i: int) -> bool:
                out = executor.execute(
                    tenant_id=tenant,
                    operation=OPERATION,
                    idempotency_key=key(prefix, t, i),
                    request=REQUEST,
                )
                return out.state is State.SUCCEEDED and out.replayed

            return Worker(op)

        return factory

    return factory_for


# -- workloads: the raw floor on SQLite ------------------------------------------------------

SQLITE_FLOOR_DDL = """
CREATE TABLE IF NOT EXISTS bench_floor (
    tenant_id TEXT NOT NULL,
    id TEXT NOT NULL,
    operation TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    state TEXT NOT NULL,
    provider_reference TEXT,
    version INTEGER NOT NULL,
    created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    PRIMARY KEY (tenant_id, id),
    UNIQUE (tenant_id, operation, idempotency_key)
)
"""

SQLITE_FLOOR_INSERT = """
INSERT INTO bench_floor (tenant_id, id, operation, idempotency_key, state, version)
VALUES (?, ?, ?, ?, 'in_progress', 1)
ON CONFLICT (tenant_id, operation, idempotency_key) DO NOTHING
RETURNING id, version
"""

SQLITE_FLOOR_UPDATE = """
UPDATE bench_floor
SET state = 'succeeded', provider_reference = ?, version = version + 1,
    updated_at = strftime('%Y-%m-%d %H:%M:%f', 'now')
WHERE tenant_id = ? AND id = ? AND version = ?
RETURNING version
"""


def sqlite_connect(path: str) -> sqlite3.Connection:
    """The pragmas payorch's SQLite engine sets (WAL, synchronous=NORMAL, busy timeout)."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=30000")
    return conn


def prepare_sqlite_floor(path: str) -> None:
    conn = sqlite_connect(path)
    try:
        conn.execute(SQLITE_FLOOR_DDL)
    finally:
        conn.close()


def sqlite_floor_workload(path: str, tenant: str) -> Callable[[str], Factory]:
    """The same two commits in plain sqlite3, each transaction ``BEGIN IMMEDIATE``."""

    def factory_for(prefix: str) -> Factory:
        def factory(t: int) -> Worker:
            conn = sqlite_connect(path)

            def op(i: int) -> bool:
                conn.execute("BEGIN IMMEDIATE")
                # fetchall: a RETURNING statement must finish before its COMMIT.
                rows = conn.execute(
                    SQLITE_FLOOR_INSERT, (tenant, new_id(), OPERATION, key(prefix, t, i))
                ).fetchall()
                conn.execute("COMMIT")
                if not rows:
                    return False
                op_id, version = rows[0]
                conn.execute("BEGIN IMMEDIATE")
                done = conn.execute(
                    SQLITE_FLOOR_UPDATE, (f"ref_{op_id}", tenant, op_id, version)
                ).fetchall()
                conn.execute("COMMIT")
                return bool(done)

            return Worker(op, conn.close)

        return factory

    return factory_for
