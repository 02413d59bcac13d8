"""Run payorch's synchronous flows on an event loop: SQLAlchemy's greenlet bridge.

The async API does not repeat the store, the executor or the webhook handler. Their sync
code runs inside :func:`run_bridged` (a greenlet driven by the event loop); each database
round trip on an async engine, each provider call and each pause then *awaits* on the loop
instead of blocking it. One place decides; the sync and the async driver only do the I/O.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy.util import concurrency

__all__ = ["bridged", "pause", "run_bridged", "wait_for"]

T = TypeVar("T")

# ``await_only`` is ``await_`` from SQLAlchemy 2.1 on (the old name is deprecated later).
_await: Callable[[Awaitable[Any]], Any] = getattr(concurrency, "await_", None) or (
    concurrency.await_only
)


def bridged() -> bool:
    """Whether this code runs under :func:`run_bridged`, i.e. on behalf of an event loop."""
    return bool(concurrency.in_greenlet())


def wait_for(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` from synchronous code running under :func:`run_bridged`."""
    result: T = _await(awaitable)
    return result


def pause(seconds: float) -> None:
    """Sleep without blocking the event loop when bridged, plainly otherwise."""
    if bridged():
        wait_for(asyncio.sleep(seconds))
    else:
        time.sleep(seconds)


async def run_bridged(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run the synchronous ``fn`` on the running loop; its bridged waits await there."""
    return await concurrency.greenlet_spawn(fn, *args, **kwargs)
