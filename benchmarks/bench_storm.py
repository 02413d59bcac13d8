"""The duplicate storm: N concurrent identical requests (one key) with ``wait=``.

One request wins the claim and calls a provider that answers after ``latency``; the others
find the key in progress and wait for the winner's outcome. A loser's lag is the time from the
provider's answer (the winner commits right after it, so this is an upper bound on the lag
after the commit) until that loser has its answer. The winner's latency is compared with a
lone request's against the same provider. Figures only; nothing is asserted.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import bench_execute as bx
from rich.console import Console
from rich.table import Table

from payorch import Executor, Store
from payorch.core import State
from payorch.operations import default_registry
from payorch.provider import Answer, SubmitRequest
from payorch.storage._store import new_id

__all__ = ["StormResult", "print_storm", "run_storm"]

GOAL_SLACK_MS = 20.0  # the goal: losers' p99 lag <= provider latency + this


class SlowProvider(bx.InstantProvider):
    """Answers ``succeeded`` after ``latency``; remembers when each answer left."""

    def __init__(self, latency: float) -> None:
        super().__init__("instant")
        self.latency = latency
        self.answered: dict[str, float] = {}  # operation id -> perf_counter at the answer
        self.calls = 0

    @property
    def max_call_duration(self) -> timedelta:
        return timedelta(seconds=5)

    def submit(self, request: SubmitRequest) -> Answer:
        self.calls += 1
        time.sleep(self.latency)  # the provider's latency, simulated
        answer = super().submit(request)
        self.answered[request.operation_id] = time.perf_counter()
        return answer


@dataclass(frozen=True, kw_only=True)
class StormResult:
    executors: str  # "one" (one process: flights) or "each" (one per request: the listener)
    storms: int
    size: int
    latency_ms: float
    lone_ms: float  # median latency of a request alone
    winner_ms: list[float]
    loser_total_ms: list[float]  # from the request's start
    loser_lag_ms: list[float]  # after the provider's answer
    provider_calls: int
    unexpected: int  # answers that were not succeeded

    @staticmethod
    def pct(values: list[float], q: float) -> float:
        if not values:
            return 0.0
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    @property
    def goal_ms(self) -> float:
        return self.latency_ms + GOAL_SLACK_MS


def _storm(
    executor: Callable[[], Executor], tenant: str, size: int
) -> list[tuple[float, float, bool, str, bool]]:
    key = f"storm-{new_id()}"
    start_line = threading.Barrier(size)
    done: list[tuple[float, float, bool, str, bool]] = []  # start, end, replayed, id, ok
    lock = threading.Lock()

    def body() -> None:
        start_line.wait()
        began = time.perf_counter()
        try:
            out = executor().execute(
                tenant_id=tenant,
                operation=bx.OPERATION,
                idempotency_key=key,
                request=bx.REQUEST,
                wait=timedelta(seconds=30),
            )
        except Exception:  # noqa: BLE001 - counted as not succeeded, the storm goes on
            with lock:
                done.append((began, time.perf_counter(), True, "", False))
            return
        end = time.perf_counter()
        with lock:
            done.append((began, end, out.replayed, out.operation_id, out.state is State.SUCCEEDED))

    pool = [threading.Thread(target=body, daemon=True) for _ in range(size)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return done


def run_storm(
    url: str,
    *,
    tenant: str,
    storms: int,
    executors: str = "one",
    size: int = 100,
    latency: float = 0.05,
) -> StormResult:
    """``executors="one"``: every request through one executor (one process: the losers
    join the winner's flight); ``"each"``: an executor per request over one store (as across
    processes: the losers wait on the store's listener)."""
    provider = SlowProvider(latency)
    store = Store.from_url(url)

    def make() -> Executor:
        return Executor(
            store=store,
            providers=[provider],
            registry=default_registry(provider="instant"),
            lease=timedelta(seconds=30),
            owner="bench-storm",
        )

    executor = make()
    per_request = make if executors == "each" else lambda: executor
    winner: list[float] = []
    total: list[float] = []
    lag: list[float] = []
    lone: list[float] = []
    unexpected = 0
    try:
        for i in range(10):  # a lone request's latency against the same provider
            began = time.perf_counter()
            executor.execute(
                tenant_id=tenant,
                operation=bx.OPERATION,
                idempotency_key=f"lone-{i}-{new_id()}",
                request=bx.REQUEST,
            )
            lone.append((time.perf_counter() - began) * 1000)
        calls_before = provider.calls
        for _ in range(storms):
            done = _storm(per_request, tenant, size)
            for began, end, replayed, op_id, ok in done:
                unexpected += 0 if ok else 1
                if not ok:
                    continue
                if not replayed:
                    winner.append((end - began) * 1000)
                    continue
                total.append((end - began) * 1000)
                answered = provider.answered.get(op_id)
                if answered is not None:
                    lag.append((end - answered) * 1000)
    finally:
        store.close()
    return StormResult(
        executors=executors,
        storms=storms,
        size=size,
        latency_ms=latency * 1000,
        lone_ms=statistics.median(lone),
        winner_ms=winner,
        loser_total_ms=total,
        loser_lag_ms=lag,
        provider_calls=provider.calls - calls_before,
        unexpected=unexpected,
    )


def print_storm(console: Console, results: list[StormResult]) -> None:
    if not results:
        return
    first = results[0]
    t = Table(
        title=f"Duplicate storm (PostgreSQL): {first.size} concurrent identical requests with "
        f"wait=, provider answers after {first.latency_ms:.0f} ms; {first.storms} storms (ms)",
        title_justify="left",
    )
    for col in (
        "executors",
        "lone p50",
        "winner p50",
        "losers p50 / p99 (total)",
        "losers lag p50 / p99",
        "goal: lag p99 <=",
        "met",
        "provider calls",
        "not succeeded",
    ):
        t.add_column(col, justify="right")
    p = StormResult.pct
    for r in results:
        lag99 = p(r.loser_lag_ms, 0.99)
        t.add_row(
            r.executors,
            f"{r.lone_ms:.1f}",
            f"{p(r.winner_ms, 0.5):.1f}",
            f"{p(r.loser_total_ms, 0.5):.1f} / {p(r.loser_total_ms, 0.99):.1f}",
            f"{p(r.loser_lag_ms, 0.5):.1f} / {lag99:.1f}",
            f"{r.goal_ms:.0f}",
            "yes" if r.loser_lag_ms and lag99 <= r.goal_ms else "NO",
            str(r.provider_calls),
            str(r.unexpected),
        )
    console.print(t)
    console.print(
        "  lag: from the provider's answer (the winner commits right after it) until the loser "
        "has its answer.\n"
        "  total: from the loser's request start. provider calls should equal the number of "
        "storms.\n"
        "  executors one: every request through one Executor (one process; the losers join the "
        "winner's flight).\n"
        "  executors each: an Executor per request on one store (as across processes; the "
        "losers wait on the store's listener)."
    )
