"""The async path at a provider's latency: ``AsyncExecutor`` beside an async floor.

The sandbox acquirer runs in a **separate process** (``payorch sandbox serve --latency
100ms``), so this process's CPU is the client's alone. Both arms send the same request to
it: the sandbox adapter's POST (path, headers with ``Idempotency-Key``, JSON body),
captured once from the adapter and filled with fresh keys per operation.

* **async floor**: per operation, on one event loop: take a ``psycopg.AsyncConnection``
  (autocommit) from a bare ``asyncio.Queue`` of connections opened before the clock (as
  many as payorch's async pool holds: ``pool_size`` 10 + ``max_overflow`` 20), run the
  floor's INSERT, give it back; POST to the sandbox with ``httpx.AsyncClient``; take a
  connection, run the fenced UPDATE, give it back.
* **AsyncExecutor**: ``AsyncExecutor.execute()`` on ``AsyncStore.from_url(url)`` with the
  ``SandboxProvider`` (its async client) against the same sandbox.

Both arms get an ``httpx.AsyncClient`` of their own, configured alike: as many connections
as the most operations in flight (httpx's default of 100 would queue the rest past the
adapter's 2 s pool time-out at 256), and httpx's default of 20 kept alive. httpcore 1.0.9's
pool scans its connections and queued requests on every assignment (quadratic, and each
freed connection is offered to every waiter: encode/httpcore#1035); keeping N connections
alive costs the client more CPU than reconnecting (measured here, bare POSTs at 64 in
flight: 17 ms of client CPU per request with 64 kept alive, 3.4 ms with 20; with 256 kept
alive the warm-up's connects timed out). The sandbox alone is measured with that client
and with a client per task (one connection each, no pool contention): the latter is what
the sandbox and this host's httpx can do at best. httpcore also tries ``import sniffio``
for every lock and event it sets up; anyio 4.16 no longer installs sniffio, and each failed
import searches ``sys.path`` (about a fifth of either arm's CPU at 256 in flight, profiled).

N in flight is N tasks, each looping over its share of the operations; the arms run in
interleaved rounds, the order rotating, after untimed warm-up operations. Memory per
operation in flight is measured apart (tracemalloc on), after the rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import re
import ssl
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import bench_db
import bench_execute as bx
import bench_floors as bf
import httpx
import psycopg
from figures import Options, Report, lat, ops, ratio, ratio_range, table
from rich.console import Console

from payorch import AsyncExecutor, AsyncStore
from payorch.core import State
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider
from payorch.providers.sandbox._adapter import DEFAULT_TIMEOUT
from payorch.storage._store import new_id

__all__ = ["DB_POOL", "LATENCY_S", "print_async_http", "run_async_http"]

LATENCY_S = 0.1  # the sandbox's latency for every API request
DB_POOL = 30  # payorch's async engine: pool_size 10 + max_overflow 20
KEEPALIVE = 20  # httpx's default max_keepalive_connections (see the module's docstring)
TENANT = "bench-async-http"
SECTION = "async_http"
Op = Callable[[int, int], Awaitable[bool]]  # (task, i) -> came out as expected
OpFactory = Callable[[str], Op]  # key prefix -> the operation
Say = Callable[[str], None]


# -- the sandbox, in a process of its own -----------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Sandbox:
    url: str
    secret: str
    pid: int

    def cpu_s(self) -> float:
        """The sandbox process's CPU so far (user + system), from /proc."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def sandbox_process(latency_ms: int) -> Iterator[Sandbox]:
    """``payorch sandbox serve --port 0 --latency …`` until the block ends (SIGTERM)."""
    command = [sys.executable, "-m", "payorch.cli", "sandbox", "serve", "--host", "127.0.0.1"]
    command += ["--port", "0", "--latency", f"{latency_ms}ms"]
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.Popen(  # noqa: S603 - this interpreter, fixed arguments
            command,
            stdout=out,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        try:
            url = secret = None
            for _ in range(600):  # up to 30 s for it to import payorch and listen
                out.seek(0)
                text = out.read()
                found = re.search(r"listening on (\S+)", text)
                key = re.search(r"webhook secret: (\S+)", text)
                if found and key:
                    url, secret = found.group(1), key.group(1)
                    break
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
            if url is None or secret is None:
                raise RuntimeError("the sandbox process did not say where it listens")
            yield Sandbox(url=url, secret=secret, pid=proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


# -- the request the adapter sends, captured ------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Post:
    url: str
    headers: dict[str, str]  # the adapter's own (Idempotency-Key, …), not the client's defaults
    body: Any  # parsed JSON
    template: bf.Template


class _Recording(httpx.AsyncBaseTransport):
    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.seen: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def capture_post(store: AsyncStore, sandbox: Sandbox, sender: httpx.AsyncClient) -> Post:
    """One AsyncExecutor.execute() through a recording transport: the adapter's POST (its
    headers less those ``sender``, the client that will repeat it, sets itself)."""
    recording = _Recording()
    provider = SandboxProvider(
        base_url=sandbox.url, webhook_secret=sandbox.secret, async_transport=recording
    )
    executor = _executor(store, provider, "bench-async-capture")
    key = f"capture-key-{new_id()[-12:]}"
    try:
        await executor.execute(
            tenant_id=TENANT, operation=bx.OPERATION, idempotency_key=key, request=bx.REQUEST
        )
    finally:
        await provider.aclose()
    posts = [r for r in recording.seen if r.method == "POST"]
    if len(posts) != 1:
        raise RuntimeError(f"one execute() sent {len(posts)} POSTs to the sandbox")
    request = posts[0]
    defaults = {k.lower() for k in sender.headers}
    skip = defaults | {"host", "content-length", "content-type"}
    headers = {k: v for k, v in request.headers.items() if k.lower() not in skip}
    body = json.loads(request.content)
    url = str(request.url)
    return Post(url=url, headers=headers, body=body, template=bf.Template(key, [headers, body]))


def _executor(store: AsyncStore, provider: SandboxProvider, owner: str) -> AsyncExecutor:
    return AsyncExecutor(
        store=store,
        providers=[provider],
        registry=default_registry(provider="sandbox"),
        lease=timedelta(seconds=120),
        owner=owner,
    )


def _client(connections: int, verify: ssl.SSLContext | bool = True) -> httpx.AsyncClient:
    limits = httpx.Limits(
        max_connections=connections, max_keepalive_connections=min(KEEPALIVE, connections)
    )
    return httpx.AsyncClient(timeout=DEFAULT_TIMEOUT, limits=limits, verify=verify)


# -- the arms --------------------------------------------------------------------------------


def floor_arm(pool: asyncio.Queue[Any], client: httpx.AsyncClient, post: Post) -> OpFactory:
    def for_prefix(prefix: str) -> Op:
        async def op(t: int, i: int) -> bool:
            k = bx.key(prefix, t, i)
            conn = await pool.get()
            try:
                cur = await conn.execute(bf.PG_FLOOR_INSERT, (TENANT, new_id(), bx.OPERATION, k))
                row = await cur.fetchone()
            finally:
                pool.put_nowait(conn)
            if row is None:
                return False
            op_id, version = row
            fresh = post.template.fresh(k)
            response = await client.post(
                post.url,
                json=bf.Template.fill(post.body, fresh),
                headers=bf.Template.fill(post.headers, fresh),
            )
            if response.status_code != 200:
                return False
            ref = response.json().get("id")
            conn = await pool.get()
            try:
                cur = await conn.execute(bf.PG_FLOOR_UPDATE, (ref, TENANT, op_id, version))
                done = await cur.fetchone()
            finally:
                pool.put_nowait(conn)
            return done is not None

        return op

    return for_prefix


def payorch_arm(executor: AsyncExecutor) -> OpFactory:
    def for_prefix(prefix: str) -> Op:
        async def op(t: int, i: int) -> bool:
            out = await executor.execute(
                tenant_id=TENANT,
                operation=bx.OPERATION,
                idempotency_key=bx.key(prefix, t, i),
                request=bx.REQUEST,
            )
            return out.state is State.SUCCEEDED and not out.replayed

        return op

    return for_prefix


# -- the timed loop, the rounds, the memory pass -----------------------------------------------


async def timed(op: Op, tasks: int, total: int) -> bx.RunResult:
    """``total`` operations over ``tasks`` concurrent tasks; the clock covers them."""
    counts = bx.split(total, tasks)
    latencies: list[float] = []
    unexpected = 0

    async def body(t: int) -> None:
        nonlocal unexpected
        for i in range(counts[t]):
            began = time.perf_counter()
            ok = await op(t, i)
            latencies.append(time.perf_counter() - began)
            unexpected += not ok

    began, cpu_began = time.perf_counter(), time.process_time()
    await asyncio.gather(*(body(t) for t in range(tasks)))
    return bx.RunResult(
        threads=tasks,
        ops=total,
        seconds=time.perf_counter() - began,
        latencies=latencies,
        unexpected=unexpected,
        cpu_seconds=time.process_time() - cpu_began,
    )


async def interleave(
    arms: dict[str, OpFactory],
    *,
    tasks: int,
    total: int,
    rounds: int,
    warmup: int,
    after_warmup: Callable[[], None] | None = None,
) -> bx.Comparison:
    """As :func:`bench_execute.interleave`: warm-up, then rounds with the order rotating."""
    names = list(arms)
    rounds = max(1, min(rounds, total))
    tag = new_id()[-8:]
    for name in names:
        if warmup:
            await timed(arms[name](f"{name}-w-n{tasks}-{tag}"), tasks, warmup)
    if after_warmup is not None:
        after_warmup()  # bench_db.analyze: the statistics a live database has
    collected: dict[str, list[bx.RunResult]] = {}
    for r, share in enumerate(bx.split(total, rounds)):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            op = arms[name](f"{name}-r{r}-n{tasks}-{tag}")
            collected.setdefault(name, []).append(await timed(op, tasks, share))
    return bx.Comparison(
        merged={name: bx.merge(parts) for name, parts in collected.items()}, rounds=collected
    )


def _rss_kb() -> float:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 1024


async def memory_pass(op: Op, tasks: int) -> dict[str, float]:
    """N operations at once, one per task (the provider's latency holds them in flight):
    the peak of Python's traced allocations over the baseline, per operation; and the RSS
    at that peak, and its growth, measured in a pass of its own before (tracemalloc's own
    bookkeeping is not in the traced figure, but it is resident)."""
    finished = 0

    async def one(t: int) -> None:
        nonlocal finished
        await op(t, 0)
        finished += 1

    async def run(sample: Callable[[], float]) -> tuple[float, int]:
        peak, at_peak = sample(), 0
        work = asyncio.gather(*(one(t) for t in range(tasks)))
        for _ in range(12000):  # every ~10 ms, up to 2 minutes
            if work.done():
                break
            now = sample()
            if now > peak:
                peak, at_peak = now, tasks - finished
            await asyncio.sleep(0.01)
        await work
        return peak, at_peak

    gc.collect()
    rss_before = _rss_kb()
    rss_peak, _ = await run(_rss_kb)
    finished = 0
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        peak, at_peak = await run(lambda: float(tracemalloc.get_traced_memory()[0]))
    finally:
        tracemalloc.stop()
    return {
        "kb_per_op": (peak - base) / 1024 / tasks,
        "unfinished_at_peak": float(at_peak),
        "rss_mb": rss_peak / 1024,
        "rss_growth_kb_per_op": max(0.0, rss_peak - rss_before) / tasks,
    }


async def sandbox_capacity(
    sandbox: Sandbox, post: Post, tasks: int, waves: int, *, per_task: bool
) -> dict[str, float]:
    """The sandbox alone: ``tasks`` bare httpx POSTs at once, ``waves`` times each, from one
    client as the arms have (or a client per task); answers per second against what its
    latency allows (tasks / latency), and its CPU per request."""
    # One TLS context for them all (a client builds its own otherwise: ~1 MB each).
    tls = ssl.create_default_context()
    clients = [_client(1 if per_task else tasks, tls) for _ in range(tasks if per_task else 1)]
    bad = 0

    async def body(t: int, tag: str) -> None:
        nonlocal bad
        client = clients[t if per_task else 0]
        for i in range(waves):
            fresh = post.template.fresh(f"capacity-{tag}-{t}-{i}")
            response = await client.post(
                post.url,
                json=bf.Template.fill(post.body, fresh),
                headers=bf.Template.fill(post.headers, fresh),
            )
            bad += response.status_code != 200

    try:
        tag = f"{tasks}-{int(per_task)}-{new_id()[-8:]}"
        await asyncio.gather(*(body(t, f"{tag}-w") for t in range(tasks)))  # connect first
        began, cpu, mine = time.perf_counter(), sandbox.cpu_s(), time.process_time()
        await asyncio.gather(*(body(t, tag) for t in range(tasks)))
        seconds = time.perf_counter() - began
    finally:
        for client in clients:
            await client.aclose()
    requests = tasks * waves * 2
    return {
        "requests_per_s": requests / 2 / seconds,
        "bound_per_s": tasks / LATENCY_S,
        "sandbox_cpu_ms": (sandbox.cpu_s() - cpu) / (requests / 2) * 1000,
        "client_cpu_ms": (time.process_time() - mine) / (requests / 2) * 1000,
        "errors": float(bad),
    }


# -- the whole part -------------------------------------------------------------------------


def run_async_http(db: bench_db.Database, opts: Options, report: Report, say: Say) -> None:
    """Both arms at every N in flight, interleaved; then the memory passes."""
    asyncio.run(_run(db, opts, report, say))


async def _run(db: bench_db.Database, opts: Options, report: Report, say: Say) -> None:
    top = max(opts.in_flight)
    say(f"async HTTP: starting the sandbox in its own process (latency {LATENCY_S * 1000:.0f} ms)")
    with sandbox_process(round(LATENCY_S * 1000)) as sandbox:
        bf.prepare_pg_floors(db.conninfo)
        store = AsyncStore.from_url(db.url)
        floor_client, payorch_client = _client(top), _client(top)
        provider = SandboxProvider(
            base_url=sandbox.url, webhook_secret=sandbox.secret, async_client=payorch_client
        )
        pool: asyncio.Queue[Any] = asyncio.Queue()
        conns = [
            await psycopg.AsyncConnection.connect(db.conninfo, autocommit=True)
            for _ in range(DB_POOL)
        ]
        for conn in conns:
            pool.put_nowait(conn)
        try:
            post = await capture_post(store, sandbox, floor_client)
            arms = {
                "floor": floor_arm(pool, floor_client, post),
                "payorch": payorch_arm(_executor(store, provider, "bench-async-http")),
            }
            extra: dict[str, Any] = {"latency_ms": LATENCY_S * 1000, "db_pool": DB_POOL}
            for n in opts.in_flight:
                say(f"async HTTP: {n} in flight, async floor and AsyncExecutor, interleaved")
                report.add(
                    SECTION,
                    n,
                    await interleave(
                        arms,
                        tasks=n,
                        total=max(opts.async_ops, n),
                        rounds=opts.rounds,
                        warmup=min(2 * n, opts.async_ops),
                        after_warmup=lambda: bench_db.analyze(db.conninfo),
                    ),
                )
            for n in opts.in_flight:
                for name, factory in arms.items():
                    say(f"async HTTP: memory per operation in flight, {name}, {n} at once")
                    figures = await memory_pass(factory(f"{name}-mem-n{n}-{new_id()[-8:]}"), n)
                    extra.setdefault("memory", {}).setdefault(name, {})[str(n)] = figures
            # Last: its clients would otherwise be in the memory figures above.
            for n in opts.in_flight:
                say(f"async HTTP: the sandbox alone, {n} bare requests at once")
                for per_task in (False, True):
                    extra.setdefault("sandbox" + ("_per_task" if per_task else ""), {})[
                        str(n)
                    ] = await sandbox_capacity(sandbox, post, n, waves=2, per_task=per_task)
            report.extra[SECTION] = extra
        finally:
            for conn in conns:
                await conn.close()
            await provider.aclose()
            await floor_client.aclose()
            await payorch_client.aclose()
            await store.close()


# -- the report ------------------------------------------------------------------------------


def _memory(report: Report, arm: str, n: int) -> dict[str, float] | None:
    found = report.extra.get(SECTION, {}).get("memory", {}).get(arm, {}).get(str(n))
    return found if isinstance(found, dict) else None


def memory_kb(report: Report, arm: str, n: int) -> float | None:
    m = _memory(report, arm, n)
    return m["kb_per_op"] if m else None


def print_async_http(console: Console, report: Report) -> None:
    by_n = report.sections.get(SECTION)
    if not by_n:
        return
    extra = report.extra.get(SECTION, {})
    t = table(
        f"Async: AsyncExecutor vs the async floor (psycopg AsyncConnection + httpx.AsyncClient), "
        f"sandbox in another process at {extra.get('latency_ms', 100):.0f} ms "
        "(ops/s; p50 / p99 ms)",
        (
            "in flight",
            "floor",
            "p50 / p99",
            "AsyncExecutor",
            "p50 / p99 ",
            "payorch/floor",
            "per round",
            "CPU ms/op p / f",
            "KB/op in flight p / f",
            "RSS MB p / f",
        ),
        bold=("payorch/floor",),
    )
    for n in sorted(by_n):
        floor = report.result(SECTION, n, "floor")
        mine = report.result(SECTION, n, "payorch")
        mf, mp = _memory(report, "floor", n), _memory(report, "payorch", n)
        t.add_row(
            str(n),
            ops(floor),
            lat(floor),
            ops(mine),
            lat(mine),
            ratio(mine, floor),
            ratio_range(report, SECTION, n, "payorch", "floor"),
            f"{mine.cpu_ms_per_op:.2f} / {floor.cpu_ms_per_op:.2f}" if mine and floor else "-",
            f"{mp['kb_per_op']:.1f} / {mf['kb_per_op']:.1f}" if mp and mf else "-",
            f"{mp['rss_mb']:.0f} / {mf['rss_mb']:.0f}" if mp and mf else "-",
        )
    console.print(t)
    lines = [
        f"  floor: per operation, a psycopg AsyncConnection (autocommit) from a queue of "
        f"{extra.get('db_pool', DB_POOL)} runs the floor INSERT, httpx.AsyncClient POSTs the "
        "sandbox adapter's request, a connection runs the fenced UPDATE.",
        "  AsyncExecutor: AsyncStore.from_url() with the SandboxProvider. Each arm has an "
        f"httpx.AsyncClient of its own: as many connections as the most in flight, {KEEPALIVE} "
        "kept alive.",
        "  CPU ms/op: this process's CPU (time.process_time) per operation; the sandbox's is "
        "not in it.",
        "  KB/op in flight: peak of tracemalloc's traced Python memory over its baseline, N "
        "operations at once, per operation (libpq's buffers are not in it); RSS: the process "
        "at that peak.",
    ]
    for kind, how in (("sandbox", "one client"), ("sandbox_per_task", "a client per task")):
        for n, cap in sorted(extra.get(kind, {}).items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"  the sandbox alone, {n} bare httpx POSTs at once, {how}: "
                f"{cap['requests_per_s']:,.0f} req/s of {cap['bound_per_s']:,.0f} its latency "
                f"allows; CPU per request {cap['client_cpu_ms']:.2f} ms here, "
                f"{cap['sandbox_cpu_ms']:.2f} ms in the sandbox; {cap['errors']:.0f} errors"
            )
    console.print("\n".join(lines), highlight=False)
