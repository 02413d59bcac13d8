"""Bounded waits for an operation in progress to settle.

On PostgreSQL one listener per store (a single connection, LISTEN, outside the pool) wakes
waiters as soon as the store's NOTIFY says their operation left ``in_progress``: a waiter
reads the operation once after it is registered (so a NOTIFY it could have missed is not
waited for), then once per wake-up, one statement each, and otherwise only every
``_POLL_CAP`` seconds as a safety net. However many requests wait, they cost one
connection and no database work while nothing changes; if that connection fails, waiters
poll every ``_POLL_FALLBACK`` seconds until it is back. SQLite waiters poll with backoff.

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
_POLL_CAP = 5.0  # seconds between re-reads while the listener is up (NOTIFY wakes sooner)
_POLL_FALLBACK = 1.0  # seconds between re-reads while it is not
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
        self._changed = threading.Condition(self._lock)
        self._waiters: dict[str, set[Waker]] = {}
        self._stop = threading.Event()
        self._listening = threading.Event()  # LISTEN is in force: a NOTIFY cannot be missed
        self._thread: threading.Thread | None = None

    @property
    def listening(self) -> bool:
        return self._listening.is_set()

    def register(self, key: str) -> Waker:
        """A waker for ``key`` (``tenant:operation id``). Every NOTIFY for the key from
        the LISTEN on reaches it, and the LISTEN itself wakes every waiter registered
        before it (their look may have preceded a NOTIFY nobody heard)."""
        event = LoopWaker() if bridged() else Waker()
        with self._lock:
            self._waiters.setdefault(key, set()).add(event)
            self._changed.notify_all()
        self.start(timeout=0)
        return event

    def unregister(self, key: str, event: Waker) -> None:
        with self._lock:
            events = self._waiters.get(key)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiters[key]
            self._changed.notify_all()

    def start(self, timeout: float) -> bool:
        """Start listening now rather than for the first waiter; True once LISTEN holds."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="payorch-listener", daemon=True
                )
                self._thread.start()
        return self._listening.wait(timeout)

    def wait_for_waiters(self, count: int, timeout: float) -> bool:
        """Block until ``count`` waiters are registered (tests, benchmarks); False on time-out."""
        with self._changed:
            return self._changed.wait_for(
                lambda: sum(len(e) for e in self._waiters.values()) >= count, timeout
            )

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
                    self._listening.set()
                    # Whoever registered before the LISTEN may have missed their NOTIFY.
                    self._wake_all()
                    while not self._stop.is_set():
                        for note in pg.notifies(timeout=_POLL_FALLBACK):
                            self._wake(note.payload)
            except psycopg.Error:
                # Waiters poll meanwhile (and look once now); try again shortly.
                self._listening.clear()
                self._wake_all()
                self._stop.wait(_RECONNECT_DELAY)
        self._listening.clear()

    def _wake_all(self) -> None:
        with self._lock:
            for events in self._waiters.values():
                for event in events:
                    event.set()


Reread = Callable[[OperationRecord], OperationRecord]


def wait_until_settled(
    store: Store, record: OperationRecord, wait: timedelta, *, reread: Reread | None = None
) -> OperationRecord:
    """Wait up to ``wait`` for ``record`` to leave ``in_progress``; return it as it is then.

    ``reread`` is how each look reads it (default ``store.get``; the claim counts the
    replay a wait ends in).
    """
    deadline = time.monotonic() + wait.total_seconds()
    look = reread or (lambda r: store.get(r.tenant_id, r.id))
    listener = store.listener()
    if listener is None:  # SQLite: poll with backoff
        return _poll(look, record, deadline, nap=pause, first=0.02, cap=lambda: 0.25)
    key = f"{record.tenant_id}:{record.id}"
    woken = listener.register(key)

    def cap() -> float:
        return _POLL_CAP if listener.listening else _POLL_FALLBACK

    try:
        return _poll(look, record, deadline, nap=woken.nap, first=cap(), cap=cap)
    finally:
        listener.unregister(key, woken)


def _poll(
    look: Reread,
    record: OperationRecord,
    deadline: float,
    *,
    nap: Callable[[float], None],
    first: float,
    cap: Callable[[], float],
) -> OperationRecord:
    delay = first
    current = look(record)
    while current.state is State.IN_PROGRESS:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        nap(min(delay, remaining))
        delay = min(delay * 2, cap())
        current = look(current)
    return current
