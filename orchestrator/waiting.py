"""Bounded waits for an operation in progress to settle.

Waiters re-read the operation at least once a second, so a wait is correct on its own; on
PostgreSQL one listener per store (a single connection, LISTEN, outside the pool) wakes them
as soon as the store's NOTIFY says their operation left ``in_progress``. However many
requests wait, they cost one connection; if that connection fails, waiters simply poll.

Under the async API (:mod:`payorch.bridge`) a wait never blocks the event loop: naps are
``asyncio.sleep`` and the listener thread wakes a waiter through its loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from .bridge import bridged, pause, wait_for
from .core import State
from .records import OperationRecord

if TYPE_CHECKING:
    from .store import Store

__all__ = ["NOTIFY_CHANNEL", "Listener", "LoopWaker", "Waker", "wait_until_settled"]

NOTIFY_CHANNEL = "payorch_operations"
_POLL_CAP = 1.0  # seconds between re-reads, notification or not
_RECONNECT_DELAY = 1.0


class Waker:
    """What a waiter naps on: set from the listener thread, cleared after each nap."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def nap(self, seconds: float) -> None:
        self._event.wait(seconds)
        self._event.clear()


class LoopWaker(Waker):
    """A waiter on an event loop: the listener thread hands the wake-up to that loop."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._woken = asyncio.Event()

    def set(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._woken.set)

    def nap(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            wait_for(asyncio.wait_for(self._woken.wait(), seconds))
        self._woken.clear()


class Listener:
    """One LISTEN connection shared by every waiter of a store."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._lock = threading.Lock()
        self._waiters: dict[str, set[Waker]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self, key: str) -> Waker:
        event = LoopWaker() if bridged() else Waker()
        with self._lock:
            self._waiters.setdefault(key, set()).add(event)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="payorch-listener", daemon=True
                )
                self._thread.start()
        return event

    def unregister(self, key: str, event: Waker) -> None:
        with self._lock:
            events = self._waiters.get(key)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiters[key]

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=_POLL_CAP * 3)

    def _wake(self, key: str) -> None:
        with self._lock:
            for event in self._waiters.get(key, ()):
                event.set()

    def _run(self) -> None:
        # Imported here: psycopg is the `postgres` extra, absent from a SQLite-only install.
        import psycopg

        while not self._stop.is_set():
            try:
                with psycopg.connect(self._dsn, autocommit=True, connect_timeout=10) as pg:
                    pg.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    while not self._stop.is_set():
                        for note in pg.notifies(timeout=_POLL_CAP):
                            self._wake(note.payload)
            except psycopg.Error:
                # Waiters keep polling meanwhile; try again shortly.
                self._stop.wait(_RECONNECT_DELAY)


def wait_until_settled(store: Store, record: OperationRecord, wait: timedelta) -> OperationRecord:
    """Wait up to ``wait`` for ``record`` to leave ``in_progress``; return it as it is then."""
    deadline = time.monotonic() + wait.total_seconds()
    listener = store.listener()
    if listener is None:  # SQLite: poll with backoff
        return _poll(store, record, deadline, nap=pause, first=0.02, cap=0.25)
    key = f"{record.tenant_id}:{record.id}"
    woken = listener.register(key)
    try:
        return _poll(store, record, deadline, nap=woken.nap, first=_POLL_CAP, cap=_POLL_CAP)
    finally:
        listener.unregister(key, woken)


def _poll(
    store: Store,
    record: OperationRecord,
    deadline: float,
    *,
    nap: Callable[[float], None],
    first: float,
    cap: float,
) -> OperationRecord:
    delay = first
    current = store.get(record.tenant_id, record.id)
    while current.state is State.IN_PROGRESS:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        nap(min(delay, remaining))
        delay = min(delay * 2, cap)
        current = store.get(record.tenant_id, record.id)
    return current
