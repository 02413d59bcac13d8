"""The async row: ``AsyncExecutor.execute()`` with N concurrent tasks on one event loop.

Interleaved with the sync arms (same rounds, same keys scheme); a thread count N of the sync
arms is N concurrent tasks here, on one thread.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import bench_execute as bx

from payorch import AsyncExecutor, AsyncStore
from payorch.core import State
from payorch.operations import default_registry

__all__ = ["AsyncBench"]


class AsyncBench:
    """An AsyncExecutor (instant provider) on a loop of its own, kept across rounds: the
    engine's pooled connections belong to the loop that opened them."""

    def __init__(self, url: str, *, tenant: str, owner: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._tenant = tenant
        self._store = AsyncStore.from_url(url)
        self._executor = AsyncExecutor(
            store=self._store,
            providers=[bx.InstantProvider()],
            registry=default_registry(provider="instant"),
            lease=timedelta(seconds=30),
            owner=owner,
        )

    def run(self, tasks: int, total: int, prefix: str) -> bx.RunResult:
        """``total`` fresh operations over ``tasks`` concurrent tasks; the clock covers them."""
        return self._loop.run_until_complete(self._run(tasks, total, prefix))

    async def _run(self, tasks: int, total: int, prefix: str) -> bx.RunResult:
        counts = bx.split(total, tasks)
        latencies: list[float] = []
        unexpected = 0

        async def body(t: int) -> None:
            nonlocal unexpected
            for i in range(counts[t]):
                began = time.perf_counter()
                out = await self._executor.execute(
                    tenant_id=self._tenant,
                    operation=bx.OPERATION,
                    idempotency_key=bx.key(prefix, t, i),
                    request=bx.REQUEST,
                )
                latencies.append(time.perf_counter() - began)
                if out.state is not State.SUCCEEDED or out.replayed:
                    unexpected += 1

        began, cpu_began = time.perf_counter(), time.process_time()
        await asyncio.gather(*(body(t) for t in range(tasks)))
        seconds = time.perf_counter() - began
        return bx.RunResult(
            threads=tasks,
            ops=total,
            seconds=seconds,
            latencies=latencies,
            unexpected=unexpected,
            cpu_seconds=time.process_time() - cpu_began,
        )

    def close(self) -> None:
        self._loop.run_until_complete(self._store.close())
        self._loop.close()
