"""The backlog drain: due operations resolved per second by 1 and N reconciler daemons.

N operations are charged at the sandbox (over loopback HTTP) with their answer lost
(``error_500_after``), so each is ``outcome_unknown`` and due. Then daemon processes
(``ReconcilerDaemon``, as ``payorch reconcile run`` runs it) drain them; every status
query waits ``latency`` seconds before it is sent (an HTTP transport that sleeps, standing
for a slow provider). Measured: wall time from the daemons' start until every operation
is settled, operations per second, peak RSS of each daemon, duplicate checks and effects.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
import sqlalchemy as sa
from rich.console import Console

from payorch.executor import Executor
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.store import Store
from payorch.tables import events, operations

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_bench"}


@dataclass
class DrainResult:
    daemons: int
    operations: int
    concurrency: int
    latency_ms: float
    seconds: float
    settled: int
    max_rss_mb: float
    double_checked: int
    effects: int
    startup_s: float = 0.0  # spawning the daemons until all were connected and ready
    daemon_cpu_s: float = 0.0  # all daemons' CPU (user + system), start-up included
    sandbox_cpu_s: float = 0.0  # this process: the sandbox server and the polling

    @property
    def cpu_ms_per_check(self) -> tuple[float, float]:
        """(daemons, sandbox) CPU per settled operation, in ms."""
        n = max(self.settled, 1)
        return self.daemon_cpu_s * 1000 / n, self.sandbox_cpu_s * 1000 / n

    @property
    def per_second(self) -> float:
        return self.settled / self.seconds if self.seconds > 0 else 0.0


class _SlowStatus(httpx.HTTPTransport):
    def __init__(self, latency: float) -> None:
        super().__init__()
        self._latency = latency

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            time.sleep(self._latency)  # the provider's status latency
        return super().handle_request(request)


def _daemon(  # noqa: PLR0917 - a spawned process's target takes positional arguments
    url: str,
    sandbox_url: str,
    owner: str,
    concurrency: int,
    latency: float,
    out: Any,
    ready: Any,
    go: Any,
) -> None:
    """One daemon process until SIGTERM; reports its peak RSS (MB) and CPU seconds.

    It imports, connects and builds its reconciler first, says it is ready, and starts
    draining when ``go`` is set: the clock measures draining, not Python's start-up."""
    import logging

    from payorch.daemon import ReconcilerDaemon

    logging.getLogger("apscheduler").setLevel(logging.ERROR)  # draining skips interval ticks
    from payorch.reconciler import Reconciler, ReconcilerPolicy

    store = Store.from_url(url, pool_size=concurrency + 2)  # a check holds one connection
    try:
        with SandboxProvider(base_url=sandbox_url, transport=_SlowStatus(latency)) as provider:
            rec = Reconciler(
                store=store,
                providers=[provider],
                policy=ReconcilerPolicy(concurrency=concurrency),
                owner=owner,
            )
            store.db_time()  # connected
            ready.release()
            go.wait()
            ReconcilerDaemon(rec, interval=timedelta(seconds=1)).run()
    finally:
        store.close()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.put((_peak_rss_mb(), usage.ru_utime + usage.ru_stime))


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def make_backlog(url: str, sandbox: SandboxServer, n: int) -> None:
    store = Store.from_url(url)
    try:
        with SandboxProvider(base_url=sandbox.url) as provider:
            ex = Executor(
                store=store,
                providers=[provider],
                registry=default_registry("sandbox"),
                lease=timedelta(seconds=120),
                sleep=lambda _s: None,
            )
            sandbox.inject("error_500_after", times=n)

            def one(i: int) -> None:
                ex.execute(
                    tenant_id="bench-drain",
                    operation="payment.create",
                    idempotency_key=f"drain-{i}",
                    request=PAYMENT,
                )

            with ThreadPoolExecutor(8) as pool:
                list(pool.map(one, range(n)))
        with store.engine.begin() as conn:
            conn.execute(
                sa.update(operations).values(
                    next_check_at=sa.func.now() - sa.text("interval '1 hour'")
                )
            )
    finally:
        store.close()


def _settled(store: Store) -> int:
    with store.engine.connect() as conn:
        q = sa.select(sa.func.count()).where(operations.c.state == "succeeded")
        return int(conn.execute(q).scalar_one())


def drain(
    url: str,
    sandbox: SandboxServer,
    *,
    daemons: int,
    n: int,
    concurrency: int,
    latency: float,
    limit_s: float = 600.0,
) -> DrainResult:
    """``url`` must hold ``n`` due operations (see :func:`make_backlog`)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    ready, go = ctx.Semaphore(0), ctx.Event()
    procs = [
        ctx.Process(
            target=_daemon,
            args=(url, sandbox.url, f"drain-{d}", concurrency, latency, out, ready, go),
        )
        for d in range(daemons)
    ]
    store = Store.from_url(url)
    try:
        launched = time.perf_counter()
        for p in procs:
            p.start()
        for _ in procs:
            if not ready.acquire(timeout=120):  # bounded: a daemon that never starts
                raise RuntimeError("a drain daemon did not start within 120 s")
        startup = time.perf_counter() - launched
        cpu_began = time.process_time()
        started = time.perf_counter()
        go.set()
        settled = 0
        while settled < n and time.perf_counter() - started < limit_s:  # bounded
            time.sleep(0.05)
            settled = _settled(store)
        seconds = time.perf_counter() - started  # from the release of ready daemons
        sandbox_cpu = time.process_time() - cpu_began
        for p in procs:
            os.kill(p.pid or 0, signal.SIGTERM)
        reports = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        with store.engine.connect() as conn:
            per_op = conn.execute(
                sa.select(events.c.operation_id, sa.func.count())
                .where(events.c.kind == "status_query")
                .group_by(events.c.operation_id)
            ).all()
        ids = {op for op, _ in per_op}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        store.close()
    # One pass over the ledger: effects_for() per operation copies the ledger each time.
    effects = sum(
        1
        for e in sandbox.ledger()
        if e["metadata"].get("operation_id") in ids and e["status"] in ("succeeded", "processing")
    )
    return DrainResult(
        daemons=daemons,
        operations=n,
        concurrency=concurrency,
        latency_ms=latency * 1000,
        seconds=seconds,
        settled=settled,
        max_rss_mb=max(r[0] for r in reports) if reports else 0.0,
        double_checked=sum(1 for _, c in per_op if c > 1),
        effects=effects,
        startup_s=startup,
        daemon_cpu_s=sum(r[1] for r in reports),
        sandbox_cpu_s=sandbox_cpu,
    )


def print_drain(console: Console, results: list[DrainResult]) -> None:
    from rich.table import Table

    if not results:
        return
    table = Table(title="Backlog drain (PostgreSQL, sandbox over loopback, status latency 100 ms)")
    for col in (
        "daemons",
        "due ops",
        "concurrency",
        "seconds",
        "ops/s",
        "start-up s",
        "peak RSS MB",
        "CPU ms/op d / s",
        "checked twice",
        "effects",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            str(r.daemons),
            str(r.operations),
            str(r.concurrency),
            f"{r.seconds:.1f}",
            f"{r.per_second:.0f}",
            f"{r.startup_s:.1f}",
            f"{r.max_rss_mb:.0f}",
            "{:.2f} / {:.2f}".format(*r.cpu_ms_per_check),
            str(r.double_checked),
            str(r.effects),
        )
    console.print(table)
