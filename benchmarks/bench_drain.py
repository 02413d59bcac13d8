"""The backlog drain: due operations resolved per second by 1 and N reconciler daemons.

N operations are charged at the sandbox (over loopback HTTP) with their answer lost
(``error_500_after``), so each is ``outcome_unknown`` and due. Then daemon processes
(``ReconcilerDaemon``, as ``payorch reconcile run`` runs it) drain them; every status
query waits ``latency`` seconds before it is sent (an HTTP transport that sleeps, standing
for a slow provider). Measured: wall time from the daemons' start until every operation
is settled, operations per second, peak RSS of each daemon, duplicate checks and effects,
and the CPU each part spent per operation: the daemons, this process (the sandbox server),
and the PostgreSQL server when it runs on this host (read from /proc). With every part on
the same cores, their sum bounds the drain: it cannot finish sooner than the total CPU
divided by the cores.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import httpx
import sqlalchemy as sa
from rich.console import Console

from payorch import Executor, Store
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.storage._tables import events, operations

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
    daemon_cpu_s: float = 0.0  # all daemons' CPU (user + system) from their release on
    sandbox_cpu_s: float = 0.0  # this process: the sandbox server and the polling
    server_cpu_s: float | None = None  # the PostgreSQL server's processes; None: not on this host
    floor: bool = False  # the bare floor (httpx and psycopg, no payorch), not the daemons

    @property
    def cpu_ms_per_check(self) -> tuple[float, float]:
        """(daemons, sandbox) CPU per settled operation, in ms."""
        n = max(self.settled, 1)
        return self.daemon_cpu_s * 1000 / n, self.sandbox_cpu_s * 1000 / n

    @property
    def server_ms_per_check(self) -> float | None:
        """The PostgreSQL server's CPU per settled operation, in ms (None: not measured)."""
        if self.server_cpu_s is None:
            return None
        return self.server_cpu_s * 1000 / max(self.settled, 1)

    @property
    def cpu_bound_s(self) -> float | None:
        """The shortest drain the CPU allows: every part's CPU over this host's cores."""
        if self.server_cpu_s is None:
            return None
        total = self.daemon_cpu_s + self.sandbox_cpu_s + self.server_cpu_s
        return total / (os.cpu_count() or 1)

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

    from payorch import ReconcilerDaemon

    logging.getLogger("apscheduler").setLevel(logging.ERROR)  # draining skips interval ticks
    from payorch import Reconciler, ReconcilerPolicy

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
            began = resource.getrusage(resource.RUSAGE_SELF)  # start-up is not draining
            ready.release()
            go.wait()
            ReconcilerDaemon(rec, interval=timedelta(seconds=1)).run()
    finally:
        store.close()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime - (began.ru_utime + began.ru_stime)
    out.put((_peak_rss_mb(), cpu))


class ServerCpu:
    """CPU seconds spent by a PostgreSQL server on this host: its postmaster, the children
    it has reaped (ended backends) and its live children, from /proc."""

    def __init__(self, postmaster: int) -> None:
        self._postmaster = postmaster
        self._tick = os.sysconf("SC_CLK_TCK")

    @classmethod
    def of(cls, url: str) -> ServerCpu | None:
        """The server behind ``url`` if it runs here and /proc shows it, else None."""
        store = Store.from_url(url)
        try:
            with store.engine.connect() as conn:
                backend = int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
            stat = _proc_stat(backend)
            if stat is None:
                return None
            postmaster = int(stat[1])  # the backend's parent
            with open(f"/proc/{postmaster}/cmdline", "rb") as f:
                if b"postgres" not in f.read():
                    return None
            return cls(postmaster)
        except (OSError, ValueError, sa.exc.SQLAlchemyError):
            return None
        finally:
            store.close()

    def seconds(self) -> float:
        own = _proc_stat(self._postmaster)
        if own is None:
            return 0.0
        # Fields after the command: state ppid ... utime(11) stime(12) cutime(13) cstime(14).
        ticks = sum(int(v) for v in own[11:15])
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = _proc_stat(int(entry))
                if stat is not None and int(stat[1]) == self._postmaster:
                    ticks += int(stat[11]) + int(stat[12])
        return ticks / self._tick


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command's closing parenthesis (a process may be gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


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


def _any_active(store: Store) -> bool:
    """Whether an operation is still to settle: the first entry of the active partial index
    answers it. A count would walk every entry left (and their heap rows) 20 times a second,
    server CPU charged to the drain it measures."""
    with store.engine.connect() as conn:
        # Literal, as the index's predicate is: a bound list would not match it in a generic plan.
        active = sa.text("state IN ('in_progress', 'outcome_unknown')")
        q = sa.select(sa.literal(1)).select_from(operations).where(active).limit(1)
        return conn.execute(q).first() is not None


class _Processes:
    """Spawned drain processes, released together once all are ready; the clock runs from
    the release. Each target gets ``(*args, out, ready, go)`` and puts ``(peak RSS MB, CPU
    seconds)`` on ``out`` when it ends."""

    def __init__(self, url: str, target: Callable[..., None], args: list[tuple[Any, ...]]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.out = ctx.Queue()
        ready, self._go = ctx.Semaphore(0), ctx.Event()
        self._ready = ready
        self.procs = [
            ctx.Process(target=target, args=(*a, self.out, ready, self._go)) for a in args
        ]
        self._server = ServerCpu.of(url)
        self.startup_s = self.seconds = self.sandbox_cpu_s = 0.0
        self.server_cpu_s: float | None = None

    def release(self) -> None:
        launched = time.perf_counter()
        for p in self.procs:
            p.start()
        for _ in self.procs:
            if not self._ready.acquire(timeout=120):  # bounded: a process that never starts
                raise RuntimeError("a drain process did not start within 120 s")
        self.startup_s = time.perf_counter() - launched
        self._cpu_began = time.process_time()
        self._server_began = self._server.seconds() if self._server is not None else 0.0
        self.started = time.perf_counter()
        self._go.set()

    def clock(self) -> None:
        """The drain is over: wall time and CPU from the release."""
        self.seconds = time.perf_counter() - self.started
        self.sandbox_cpu_s = time.process_time() - self._cpu_began
        if self._server is not None:
            self.server_cpu_s = self._server.seconds() - self._server_began

    def reports(self, timeout: float) -> list[tuple[float, float]]:
        reports = [self.out.get(timeout=timeout) for _ in self.procs]
        for p in self.procs:
            p.join(timeout=60)
        return reports

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def result(
        self, reports: list[tuple[float, float]], *, n: int, concurrency: int, latency: float
    ) -> DrainResult:
        return DrainResult(
            daemons=len(self.procs),
            operations=n,
            concurrency=concurrency,
            latency_ms=latency * 1000,
            seconds=self.seconds,
            settled=0,
            max_rss_mb=max(r[0] for r in reports) if reports else 0.0,
            double_checked=0,
            effects=0,
            startup_s=self.startup_s,
            daemon_cpu_s=sum(r[1] for r in reports),
            sandbox_cpu_s=self.sandbox_cpu_s,
            server_cpu_s=self.server_cpu_s,
        )


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
    procs = _Processes(
        url,
        _daemon,
        [(url, sandbox.url, f"drain-{d}", concurrency, latency) for d in range(daemons)],
    )
    store = Store.from_url(url)
    try:
        # The statistics a live database has (the floor's run gets the same, below).
        with store.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                "VACUUM ANALYZE payorch_operations"
            )
        procs.release()
        while time.perf_counter() - procs.started < limit_s:  # bounded
            time.sleep(0.05)
            if not _any_active(store):
                break
        procs.clock()
        settled = _settled(store)
        for p in procs.procs:
            os.kill(p.pid or 0, signal.SIGTERM)
        reports = procs.reports(60)
        with store.engine.connect() as conn:
            per_op = conn.execute(
                sa.select(events.c.operation_id, sa.func.count())
                .where(events.c.kind == "status_query")
                .group_by(events.c.operation_id)
            ).all()
            # The ledger knows an effect by the downstream key it was made under (derived
            # from the namespace, not the operation id).
            keys = set(conn.execute(sa.select(operations.c.downstream_key)).scalars())
    finally:
        procs.kill()
        store.close()
    # One pass over the ledger: effects_for() per operation copies the ledger each time.
    effects = sum(
        1
        for e in sandbox.ledger()
        if e["idempotency_key"] in keys and e["status"] in ("succeeded", "processing")
    )
    result = procs.result(reports, n=n, concurrency=concurrency, latency=latency)
    return replace(
        result,
        settled=settled,
        double_checked=sum(1 for _, c in per_op if c > 1),
        effects=effects,
    )


# -- the floor: the same drain without payorch ----------------------------------------------

# Up to FLOOR_CLAIM due operations per statement, leased with SKIP LOCKED as the daemons do.
FLOOR_CLAIM_SQL = """
UPDATE payorch_operations SET lease_owner = %(owner)s,
    lease_expires_at = now() + interval '60 seconds'
WHERE (tenant_id, id) IN (
    SELECT tenant_id, id FROM payorch_operations
    WHERE state IN ('in_progress', 'outcome_unknown') AND next_check_at <= now()
      AND (lease_expires_at IS NULL OR lease_expires_at < now())
    ORDER BY next_check_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
RETURNING tenant_id, id, downstream_key, version
"""
FLOOR_SETTLE_SQL = """
UPDATE payorch_operations SET state = 'succeeded', provider_reference = %(ref)s,
    version = version + 1, lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
WHERE tenant_id = %(tenant)s AND id = %(id)s AND version = %(version)s
RETURNING version
"""
FLOOR_CLAIM = 16


def _floor_daemon(  # noqa: PLR0917 - a spawned process's target takes positional arguments
    conninfo: str,
    sandbox_url: str,
    concurrency: int,
    latency: float,
    out: Any,
    ready: Any,
    go: Any,
) -> None:
    """The least a drain daemon can do: ``concurrency`` threads, each with its own psycopg
    connection in autocommit, claim due operations, ask the sandbox for each (the same
    httpx transport and latency as the daemons), and settle it in one fenced UPDATE. No
    lease per check, no events, no evidence, no deadline, no validation."""
    import psycopg

    connections = [psycopg.connect(conninfo, autocommit=True) for _ in range(concurrency)]
    client = httpx.Client(base_url=sandbox_url, transport=_SlowStatus(latency))
    began = resource.getrusage(resource.RUSAGE_SELF)
    ready.release()
    go.wait()

    def work(conn: psycopg.Connection[Any], owner: str) -> None:
        while True:
            batch = conn.execute(FLOOR_CLAIM_SQL, {"owner": owner, "limit": FLOOR_CLAIM}).fetchall()
            if not batch:
                return
            for tenant, op_id, key, version in batch:
                body = client.get("/v1/effects", params={"idempotency_key": key}).json()
                ref = body["data"][0]["id"] if body.get("data") else None
                settle = {"ref": ref, "tenant": tenant, "id": op_id, "version": version}
                conn.execute(FLOOR_SETTLE_SQL, settle).fetchone()

    threads = [
        threading.Thread(target=work, args=(conn, f"floor-{os.getpid()}-{i}"))
        for i, conn in enumerate(connections)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime - (began.ru_utime + began.ru_stime)
    client.close()
    for conn in connections:
        conn.close()
    out.put((_peak_rss_mb(), cpu))


def make_due_again(url: str) -> None:
    """Every operation of a drained backlog due and unknown again (for the floor's run)."""
    store = Store.from_url(url)
    try:
        with store.engine.begin() as conn:
            conn.execute(
                sa.update(operations).values(
                    state="outcome_unknown",
                    version=operations.c.version + 1,
                    lease_owner=None,
                    lease_expires_at=None,
                    next_check_at=sa.func.now() - sa.text("interval '1 hour'"),
                )
            )
        with store.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                "VACUUM ANALYZE payorch_operations"
            )
    finally:
        store.close()


def floor_drain(
    url: str,
    conninfo: str,
    sandbox: SandboxServer,
    *,
    processes: int,
    n: int,
    concurrency: int,
    latency: float,
    limit_s: float = 600.0,
) -> DrainResult:
    """The drain's floor on ``n`` due operations (see :func:`make_due_again`): ``processes``
    bare daemons (:func:`_floor_daemon`). What payorch's daemons are compared with."""
    procs = _Processes(
        url, _floor_daemon, [(conninfo, sandbox.url, concurrency, latency)] * processes
    )
    try:
        procs.release()
        reports = procs.reports(limit_s)  # bounded; each ends when nothing is left due
        procs.clock()
    finally:
        procs.kill()
    store = Store.from_url(url)
    try:
        settled = _settled(store)
    finally:
        store.close()
    # The floor writes no events: checks twice and effects are not recorded.
    result = procs.result(reports, n=n, concurrency=concurrency, latency=latency)
    return replace(result, settled=settled, floor=True)


def print_drain(console: Console, results: list[DrainResult]) -> None:
    from rich.table import Table

    if not results:
        return
    table = Table(title="Backlog drain (PostgreSQL, sandbox over loopback, status latency 100 ms)")
    for col in (
        "run",
        "daemons",
        "due ops",
        "concurrency",
        "seconds",
        "ops/s",
        "start-up s",
        "peak RSS MB",
        "CPU ms/op d / s / pg",
        "CPU-bound s",
        "checked twice",
        "effects",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            "floor" if r.floor else "payorch",
            str(r.daemons),
            str(r.operations),
            str(r.concurrency),
            f"{r.seconds:.1f}",
            f"{r.per_second:.0f}",
            f"{r.startup_s:.1f}",
            f"{r.max_rss_mb:.0f}",
            " / ".join(
                [f"{v:.2f}" for v in r.cpu_ms_per_check]
                + ["-" if r.server_ms_per_check is None else f"{r.server_ms_per_check:.2f}"]
            ),
            "-" if r.cpu_bound_s is None else f"{r.cpu_bound_s:.1f}",
            "-" if r.floor else str(r.double_checked),
            "-" if r.floor else str(r.effects),
        )
    console.print(table)
    if any(r.floor for r in results):
        console.print(
            "  floor: the same backlog made due again and drained by as many bare processes,"
            " each with as many threads: a claim of 16 per statement, the same httpx transport and"
            " latency per status query, one fenced UPDATE per operation; nothing else (no lease per"
            " check, event, evidence, deadline or validation): what this host allows for the work"
            " itself."
        )
    console.print(
        "  CPU ms/op d / s / pg: CPU per settled operation of all daemons (from their release), of"
        " this process (the sandbox server), of the PostgreSQL server (its processes on this host;"
        " - when it runs elsewhere)."
    )
    console.print(
        f"  CPU-bound s: that CPU summed, over this host's {os.cpu_count()} cores: with every part"
        " on the same cores, no drain of these operations can be shorter."
    )
