"""A read that answers within its time-out or not at all, and never piles threads up.

A scrape or a probe must answer even when the database does not: each read runs on a worker
thread and is waited for at most a time-out, and while one is stuck no other is started.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

from ..forks import reset_in_child

__all__ = ["OneAtATime"]

T = TypeVar("T")


class OneAtATime(Generic[T]):
    """Calls ``fn`` on a worker thread and waits at most ``timeout``; ``None`` on failure or
    time-out. While an earlier call is still stuck (a hung database), answers ``None`` at
    once instead of starting another: scrapes and probes never pile threads up."""

    def __init__(self, fn: Callable[[], T], *, timeout: float) -> None:
        self.fn = fn
        self.timeout = timeout
        self._start()
        # A forked child has no thread behind a call in flight at the fork.
        reset_in_child(self, OneAtATime._start)

    def _start(self) -> None:
        self._lock = threading.Lock()
        self._inflight: Future[T] | None = None

    def __call__(self) -> T | None:
        with self._lock:
            if self._inflight is not None and not self._inflight.done():
                return None
            future: Future[T] = Future()
            self._inflight = future

        def run() -> None:
            try:
                future.set_result(self.fn())
            except Exception as exc:  # noqa: BLE001 - any failure reads as "no answer"
                future.set_exception(exc)

        threading.Thread(target=run, name="payorch-monitor-read", daemon=True).start()
        try:
            return future.result(timeout=self.timeout)
        except Exception:  # noqa: BLE001 - time-out or database error: no answer
            return None
