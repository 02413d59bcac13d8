"""Where one operation's client CPU goes: prepare, claim, provider call, record, the rest.

One operation at a time (one thread; one task on the loop for the async API), fresh keys,
the in-process instant provider, so the parts are the library's work alone. Each part is
the thread's CPU (``time.thread_time``) between entering and leaving a phase, nested phases
subtracted: prepare (``Registry.prepare``: validation, JSON form, fingerprint, the stored
copy), claim (``Store.claim``), provider call (the adapter's ``submit``, with the bridge's
await for the async API), record (``Store.transition``). The claim and the record are split
again into the driver's part (psycopg executing a statement and fetching its row, the round
trip's system calls included; for the async API its await and the loop's turn) and
payorch's (the pool, the parameters, the record built from the row). "rest" is what
``execute()`` spends outside those phases (metrics, the outcome, the executor's own steps;
for the async API also the greenlet). Measuring costs a few system calls per phase, so the
parts add up to slightly more than an unmeasured run.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import bench_execute as bx

from payorch import AsyncExecutor, AsyncStore, Executor, Store
from payorch.execution._async import _Bridged
from payorch.operations import Registry, default_registry
from payorch.storage import _driver_sql as engine_module
from payorch.storage._store import Store as StoreClass

__all__ = ["PHASES", "Breakdown", "measure", "print_breakdown", "summary"]

PHASES = ("prepare", "claim", "claim.driver", "provider", "record", "record.driver", "rest")


class Breakdown:
    """Exclusive CPU per phase over ``ops`` operations (ms per operation)."""

    def __init__(self) -> None:
        self.cpu: Counter[str] = Counter()
        self.ops = 0
        self.total = 0.0
        self._stack: list[str] = []
        self._since: list[float] = []

    def per_op_ms(self, phase: str) -> float:
        return self.cpu[phase] / self.ops * 1000 if self.ops else 0.0

    @property
    def total_ms(self) -> float:
        return self.total / self.ops * 1000 if self.ops else 0.0

    def enter(self, phase: str) -> None:
        now = time.thread_time()
        if self._stack:
            self.cpu[self._stack[-1]] += now - self._since[-1]
        self._stack.append(phase)
        self._since.append(now)

    def leave(self) -> None:
        now = time.thread_time()
        self.cpu[self._stack.pop()] += now - self._since.pop()
        if self._since:
            self._since[-1] = now

    @contextmanager
    def operation(self) -> Iterator[None]:
        """One measured operation: its CPU outside the phases is "rest"."""
        began = time.thread_time()
        self.enter("rest")
        try:
            yield
        finally:
            self.leave()
            self.total += time.thread_time() - began
            self.ops += 1

    def driver_phase(self) -> str | None:
        """The driver part of the phase running now (claim or record), if any."""
        current = self._stack[-1] if self._stack else None
        return f"{current}.driver" if current in ("claim", "record") else None


@contextmanager
def _patched(breakdown: Breakdown) -> Iterator[None]:
    """Wrap the phases' functions for the measurement; put them back afterwards."""
    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, phase: str | None) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            label = phase or breakdown.driver_phase()
            if label is None:
                return original(*args, **kwargs)
            breakdown.enter(label)
            try:
                return original(*args, **kwargs)
            finally:
                breakdown.leave()

        saved.append((owner, name, original))
        setattr(owner, name, timed)

    wrap(Registry, "prepare", "prepare")
    wrap(StoreClass, "claim", "claim")
    wrap(StoreClass, "transition", "record")
    wrap(bx.InstantProvider, "submit", "provider")
    wrap(_Bridged, "submit", "provider")  # the async API's await of asubmit
    # One statement on the driver connection (the async one: its await, the loop's turn
    # included), counted only inside a claim or a record.
    wrap(engine_module, "_fetch", None)
    wrap(engine_module, "_fetch_awaited", None)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _sync(url: str, ops: int, warmup: int, tag: str, settle: Callable[[], None]) -> Breakdown:
    store = Store.from_url(url)
    executor = Executor(
        store=store,
        providers=[bx.InstantProvider()],
        registry=default_registry(provider="instant"),
        lease=timedelta(seconds=30),
        owner="bench-breakdown",
    )

    def one(key: str) -> None:
        executor.execute(
            tenant_id="bench-breakdown",
            operation=bx.OPERATION,
            idempotency_key=key,
            request=bx.REQUEST,
        )

    try:
        for i in range(warmup):
            one(f"{tag}-w{i}")
        settle()
        breakdown = Breakdown()
        with _patched(breakdown):
            for i in range(ops):
                with breakdown.operation():
                    one(f"{tag}-{i}")
        return breakdown
    finally:
        store.close()


def _async(url: str, ops: int, warmup: int, tag: str, settle: Callable[[], None]) -> Breakdown:
    async def run() -> Breakdown:
        store = AsyncStore.from_url(url)
        executor = AsyncExecutor(
            store=store,
            providers=[bx.InstantProvider()],
            registry=default_registry(provider="instant"),
            lease=timedelta(seconds=30),
            owner="bench-breakdown-async",
        )

        async def one(key: str) -> None:
            await executor.execute(
                tenant_id="bench-breakdown",
                operation=bx.OPERATION,
                idempotency_key=key,
                request=bx.REQUEST,
            )

        try:
            for i in range(warmup):
                await one(f"{tag}-aw{i}")
            settle()
            breakdown = Breakdown()
            with _patched(breakdown):
                for i in range(ops):
                    with breakdown.operation():
                        await one(f"{tag}-a{i}")
            return breakdown
        finally:
            await store.close()

    return asyncio.run(run())


def measure(
    url: str,
    *,
    ops: int,
    warmup: int = 100,
    after_warmup: Callable[[], None] = lambda: None,
) -> dict[str, Breakdown]:
    """The breakdown of ``execute()`` (sync) and ``AsyncExecutor.execute()`` (async) on the
    PostgreSQL database at ``url`` (already migrated); ``after_warmup`` runs between the
    warm-up and the measured operations (the benchmark's ANALYZE)."""
    tag = bx.new_id()[-8:]
    return {
        "sync": _sync(url, ops, warmup, tag, after_warmup),
        "async": _async(url, ops, warmup, tag, after_warmup),
    }


_LABELS = {
    "prepare": "prepare (validate, JSON form, fingerprint)",
    "claim": "claim: payorch (pool, parameters, record)",
    "claim.driver": "claim: driver (psycopg, round trip)",
    "provider": "provider call (instant, in-process)",
    "record": "record: payorch (pool, parameters, record)",
    "record.driver": "record: driver (psycopg, round trip)",
    "rest": "rest (executor, metrics, outcome; async: bridge)",
}


def summary(found: dict[str, Breakdown]) -> dict[str, dict[str, float]]:
    """The figures as JSON: ms per operation per phase, and the total."""
    return {
        api: {**{phase: round(b.per_op_ms(phase), 4) for phase in PHASES}, "total": b.total_ms}
        for api, b in found.items()
    }


def print_breakdown(console: Any, found: dict[str, Breakdown]) -> None:
    from rich.table import Table

    if not found:
        return
    apis = list(found)
    ops = found[apis[0]].ops
    t = Table(
        title=f"Where one operation's client CPU goes (ms per operation, {ops} operations, one "
        "at a time, instant provider, thread CPU per phase)",
        title_justify="left",
    )
    t.add_column("phase")
    for api in apis:
        t.add_column(f"{api} ms", justify="right")
        t.add_column("share", justify="right")
    for phase in PHASES:
        cells = []
        for api in apis:
            b = found[api]
            share = b.per_op_ms(phase) / b.total_ms if b.total_ms else 0.0
            cells += [f"{b.per_op_ms(phase):.3f}", f"{share:.0%}"]
        t.add_row(_LABELS[phase], *cells)
    t.add_row("total", *[x for api in apis for x in (f"{found[api].total_ms:.3f}", "100%")])
    console.print(t)
