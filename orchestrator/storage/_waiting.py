"""Bounded waits for an operation in progress to settle.

On PostgreSQL one listener per store (a single connection, LISTEN, outside the pool) wakes
waiters as soon as the store's NOTIFY says their operation left ``in_progress``, and reads
it for them: one statement on its own connection per NOTIFY, however many requests wait
for that operation, counting each of their replays. A write sends that NOTIFY only for an
operation someone waits on (its row's ``waited``; a NOTIFY serialises commits server-wide),
so a waiter, once registered, marks the operation and reads it in one statement
(``Store.flag_waiting``: only the first waiter writes the mark); it reads it itself again
only where that read cannot be shared, and every ``_POLL_CAP`` seconds as a safety net.
However many requests wait, they cost one connection and no database work while nothing
changes; if that connection fails, waiters poll every ``_POLL_FALLBACK`` seconds until it
is back. SQLite waiters poll with backoff, and so do PostgreSQL waiters behind a transaction
pooler with no direct URL to listen on (:mod:`payorch.storage._pooling`): a LISTEN there
holds on whichever server connection it ran.

A wait never trusts the listener to answer: it re-reads on its own schedule, waits for the
listener's shared read at most ``_DELIVERY_WAIT`` seconds before reading for itself, and so
ends within its ``wait`` plus that and one read even if the LISTEN connection hangs (a peer
that stops answering). A listener whose read or heartbeat is overdue is not trusted (its
waiters poll as if it were down); one stuck for ``_STUCK_AFTER`` seconds has its connection
cut by the next waiter that notices, so it reconnects.

Under the async API (:mod:`payorch.storage._bridge`) a wait never blocks the event loop: naps are
``asyncio.sleep`` and the listener thread wakes a waiter through its loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Protocol

from ..core import State
from ..errors import PayorchError
from ..records import OperationRecord
from ._bridge import bridged, pause, wait_for

__all__ = [
    "NOTIFY_CHANNEL",
    "Listener",
    "LoopWaker",
    "Mark",
    "Waited",
    "Waker",
    "wait_until_settled",
]

NOTIFY_CHANNEL = "payorch_operations"
_POLL_CAP = 5.0  # seconds between re-reads while the listener is up (NOTIFY wakes sooner)
_POLL_FALLBACK = 1.0  # seconds between re-reads while it is not
_RECONNECT_DELAY = 1.0
# A read on a healthy connection takes milliseconds. Past this a waiter reads for itself
# and the listener is not trusted; past _STUCK_AFTER its connection is taken for hung.
_DELIVERY_WAIT = 2.0
_STUCK_AFTER = 10.0
_HEARTBEAT = 5.0  # seconds of silence after which the listener checks its connection
# libpq's: a dead peer ends the LISTEN connection in about half a minute, not hours.
_KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}


class Waker:
    """What a waiter naps on: set from the listener thread, cleared after each nap.

    The listener may also hand it the operation as read for it (``deliver``): between
    ``serving`` (set under the listener's lock) and the delivery, the waiter must not
    read it itself, or its replay would be counted twice.
    """

    def __init__(self, record: OperationRecord | None = None) -> None:
        self._event = threading.Event()
        self.record = record  # what it waits on (the listener reads it by id)
        self.serving = False  # the listener is reading for it: wait for the delivery
        self.looking = False  # it is reading for itself: the listener only wakes it
        self.look_first = True  # read before the first nap (see wait_until_settled)
        self.armed = False  # its operation is marked as waited on (Listener.arm)
        self._delivered = threading.Event()
        self._fresh: OperationRecord | None = None

    def set(self) -> None:
        self._event.set()

    def nap(self, seconds: float) -> None:
        self._event.wait(seconds)
        self._event.clear()

    def deliver(self, fresh: OperationRecord | None) -> None:
        """The listener's read (None: it failed, read it yourself)."""
        self._fresh = fresh
        self._delivered.set()
        self.set()

    @property
    def delivered(self) -> bool:
        return self._delivered.is_set()

    def await_delivery(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the listener's read; True once it came."""
        return self._delivered.wait(timeout)

    def take(self) -> OperationRecord | None:
        self._delivered.clear()
        fresh, self._fresh = self._fresh, None
        return fresh


class LoopWaker(Waker):
    """A waiter on an event loop: the listener thread hands the wake-up to that loop."""

    def __init__(self, record: OperationRecord | None = None) -> None:
        super().__init__(record)
        self._loop = asyncio.get_running_loop()
        self._woken = asyncio.Event()
        self._arrived = asyncio.Event()

    def set(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._woken.set)

    def deliver(self, fresh: OperationRecord | None) -> None:
        super().deliver(fresh)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._arrived.set)

    def nap(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            wait_for(asyncio.wait_for(self._woken.wait(), seconds))
        self._woken.clear()

    def await_delivery(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._delivered.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                wait_for(asyncio.wait_for(self._arrived.wait(), remaining))
            self._arrived.clear()
        return True


# A reader runs the waiters' read on the listener's own psycopg connection: (connection,
# the operation, how many waiters it answers) -> the operation now, their replays counted.
SharedReader = Callable[[Any, OperationRecord, int], OperationRecord]
Mark = tuple[int, int]  # (the LISTEN's generation, the last NOTIFY's number)


class Listener:
    """One LISTEN connection shared by every waiter of a store."""

    def __init__(
        self, dsn: str, *, reader: SharedReader | None = None, options: str | None = None
    ) -> None:
        self._dsn = dsn
        self._reader = reader
        self._options = options
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._waiters: dict[str, set[Waker]] = {}
        self._stop = threading.Event()
        self._listening = threading.Event()  # LISTEN is in force: a NOTIFY cannot be missed
        self._thread: threading.Thread | None = None
        self._generation = 0  # LISTENs so far: a reconnect may have missed NOTIFYs
        self._seq = 0  # NOTIFYs received
        self._pg: Any = None  # the LISTEN connection (under _lock), for cut_if_stuck
        self._busy_since: float | None = None  # when its read or heartbeat began

    @property
    def listening(self) -> bool:
        """LISTEN holds and the connection answers: a NOTIFY would be heard."""
        return self._listening.is_set() and not self._overdue(_DELIVERY_WAIT)

    def _overdue(self, seconds: float) -> bool:
        since = self._busy_since
        return since is not None and time.monotonic() - since > seconds

    def mark(self) -> Mark | None:
        """The LISTEN's generation (reconnects so far) and NOTIFYs heard, if it listens."""
        with self._lock:
            return (self._generation, self._seq) if self.listening else None

    def register(self, key: str, record: OperationRecord | None = None) -> Waker:
        """A waker for ``key`` (``tenant:operation id``). Every NOTIFY for the key from
        the LISTEN on reaches it, and the LISTEN itself wakes every waiter registered
        before it (their look may have preceded a NOTIFY nobody heard). With ``record``,
        the listener reads the operation for it when a NOTIFY comes."""
        event = LoopWaker(record) if bridged() else Waker(record)
        with self._lock:
            self._waiters.setdefault(key, set()).add(event)
            self._changed.notify_all()
        self.start(timeout=0)
        return event

    def arm(self, event: Waker) -> None:
        """``event``'s operation is marked as waited on: a write of it will NOTIFY."""
        with self._lock:
            event.armed = True
            self._changed.notify_all()

    def unregister(self, key: str, event: Waker) -> None:
        with self._lock:
            events = self._waiters.get(key)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiters[key]
            self._changed.notify_all()

    def begin_look(self, event: Waker) -> bool:
        """True if the listener is reading for ``event`` (take its delivery); else the
        waiter reads for itself (until :meth:`end_look`) and the listener only wakes it."""
        with self._lock:
            if event.serving:
                return True
            event.looking = True
            return False

    def end_look(self, event: Waker) -> None:
        with self._lock:
            event.looking = event.serving = False

    def take_delivery(self, event: Waker) -> tuple[bool, OperationRecord | None]:
        """The listener's read for ``event`` (after :meth:`begin_look` said it is reading),
        waited for at most ``_DELIVERY_WAIT``: (True, the record, or None if the read
        failed), or (False, None) if it is late. Either way without a record, read for
        yourself; what a late read delivers later goes to nobody."""
        if not event.await_delivery(_DELIVERY_WAIT):
            with self._lock:
                if not event.delivered:  # else it came just now: take it
                    event.serving = False
                    late = True
                else:
                    late = False
            if late:
                self.cut_if_stuck()
                return False, None
        return True, event.take()

    def cut_if_stuck(self, *, closing: bool = False) -> None:
        """Shut the LISTEN connection's socket down if its read or heartbeat is overdue
        (or the listener is closing): the blocked call then fails, and the listener
        reconnects or ends."""
        with self._lock:  # the listener drops _pg under the lock before closing it
            if self._pg is None or not (closing or self._overdue(_STUCK_AFTER)):
                return
            try:
                # A duplicate of the descriptor: shutting it down ends the connection, and
                # closing it leaves the listener's own descriptor to psycopg.
                dup = socket.socket(fileno=os.dup(self._pg.pgconn.socket))
            except Exception:  # noqa: BLE001 - psycopg.Error or OSError: it is closing anyway
                return
        with dup, contextlib.suppress(OSError):
            dup.shutdown(socket.SHUT_RDWR)

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
        """Block until ``count`` waiters are registered and their operations marked as
        waited on (tests, benchmarks); False on time-out."""
        with self._changed:
            return self._changed.wait_for(
                lambda: sum(e.armed for es in self._waiters.values() for e in es) >= count,
                timeout,
            )

    def close(self) -> None:
        self._stop.set()
        self.cut_if_stuck(closing=True)  # a thread blocked on a hung peer ends now
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=_POLL_CAP * 3)

    def _notified(self, key: str, pg: Any) -> None:
        """A NOTIFY for ``key``: read the operation once for every idle waiter (counting
        their replays), and wake those reading for themselves to look again."""
        with self._lock:
            self._seq += 1
            events = self._waiters.get(key, set())
            shared = self._reader is not None
            serve = [
                e
                for e in events
                if shared and e.record is not None and not (e.looking or e.serving)
            ]
            for event in events:
                if event in serve:
                    event.serving = True
                else:
                    event.set()
        if not serve:
            return
        fresh = None
        try:
            assert self._reader is not None and serve[0].record is not None
            with self._busy():
                fresh = self._reader(pg, serve[0].record, len(serve))
        except PayorchError:
            # A row that cannot be read (or is gone): each waiter reads it and gets the
            # error itself; the listener goes on. A connection error goes up: reconnect.
            pass
        finally:  # None (the read failed): each waiter reads for itself
            with self._lock:  # not to those that gave up waiting (take_delivery)
                for event in serve:
                    if event.serving:
                        event.deliver(fresh)

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        self._busy_since = time.monotonic()
        try:
            yield
        finally:
            self._busy_since = None

    def _run(self) -> None:
        # Imported here: psycopg is the `postgres` extra, absent from a SQLite-only install.
        import psycopg

        options: dict[str, Any] = {"options": self._options} if self._options else {}
        while not self._stop.is_set():
            try:
                with psycopg.connect(
                    self._dsn, autocommit=True, connect_timeout=10, **_KEEPALIVES, **options
                ) as pg:
                    try:
                        self._listen(pg)
                    finally:
                        with self._lock:
                            self._pg = None
            except psycopg.Error:
                # Waiters poll meanwhile (and look once now); try again shortly.
                self._listening.clear()
                self._wake_all()
                self._stop.wait(_RECONNECT_DELAY)
        self._listening.clear()

    def _listen(self, pg: Any) -> None:
        with self._lock:
            self._pg = pg
        with self._busy():
            pg.execute(f"LISTEN {NOTIFY_CHANNEL}")
        with self._lock:
            self._generation += 1
            self._listening.set()
        # Whoever registered before the LISTEN may have missed their NOTIFY.
        self._wake_all()
        heard = time.monotonic()
        while not self._stop.is_set():
            notes = pg.notifies(timeout=_POLL_FALLBACK, stop_after=1)
            for key in dict.fromkeys(note.payload for note in notes):
                heard = time.monotonic()
                self._notified(key, pg)
            if time.monotonic() - heard >= _HEARTBEAT:
                # A silent peer may be a dead one: an overdue answer makes it untrusted.
                with self._busy():
                    pg.execute("SELECT 1")
                heard = time.monotonic()

    def _wake_all(self) -> None:
        with self._lock:
            for events in self._waiters.values():
                for event in events:
                    event.set()


Reread = Callable[[OperationRecord], OperationRecord]


class Waited(Protocol):
    """What a wait needs of its store (a :class:`~payorch.Store`): reads, and its listener."""

    @property
    def is_postgres(self) -> bool: ...

    def get(self, tenant_id: str, operation_id: str) -> OperationRecord: ...

    def flag_waiting(self, record: OperationRecord) -> OperationRecord | None: ...

    def listener(self) -> Listener | None: ...


def wait_until_settled(
    store: Waited,
    record: OperationRecord,
    wait: timedelta,
    *,
    reread: Reread | None = None,
) -> OperationRecord:
    """Wait up to ``wait`` for ``record`` to leave ``in_progress``; return it as it is then.

    ``reread`` is how each look reads it (default ``store.get``; the claim counts the
    replay a wait ends in, and then the listener reads for it too).
    """
    deadline = time.monotonic() + wait.total_seconds()

    def plain(r: OperationRecord) -> OperationRecord:
        return store.get(r.tenant_id, r.id)

    read = reread or plain
    listener = store.listener()
    if listener is None:  # SQLite, or a transaction pooler: poll with backoff
        if store.is_postgres:
            return _poll(read, record, deadline, nap=pause, first=0.05, cap=lambda: _POLL_FALLBACK)
        return _poll(read, record, deadline, nap=pause, first=0.02, cap=lambda: 0.25)
    key = f"{record.tenant_id}:{record.id}"
    # Only a read that counts replays is shared: the listener's counts them.
    woken = listener.register(key, record if reread is not None else None)
    # Registered first: a NOTIFY sent from now on reaches this waiter (or the LISTEN, once
    # in force, wakes it). Then the mark, without which the write sends none.
    try:
        flagged = store.flag_waiting(record)
    except PayorchError:  # the mark's answer lost, say: look now, then poll as a fallback
        flagged = None
    if flagged is not None:  # in progress, and its next write will say so: nap first
        record, woken.look_first = flagged, False
    listener.arm(woken)

    def cap() -> float:
        return _POLL_CAP if listener.listening else _POLL_FALLBACK

    def look(current: OperationRecord) -> OperationRecord:
        reader = read
        if listener.begin_look(woken):
            came, fresh = listener.take_delivery(woken)
            listener.end_look(woken)
            if fresh is not None:
                return fresh
            listener.begin_look(woken)  # its read failed or is late: read for ourselves
            if not came:
                # A late read may still commit, counting this waiter's replay: read without
                # counting (should it never commit, the count is one short: in doubt).
                reader = plain
        else:
            listener.cut_if_stuck()  # reading for itself: a stuck listener may be why
        try:
            return reader(current)
        finally:
            listener.end_look(woken)

    try:
        return _poll(
            look,
            record,
            deadline,
            nap=woken.nap,
            first=cap(),
            cap=cap,
            look_first=woken.look_first,
        )
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
    look_first: bool = True,
) -> OperationRecord:
    delay = first
    current = look(record) if look_first else record
    # A released operation (nothing sent, no lease) is no longer worth waiting for: the
    # waiter may run it again.
    while current.state is State.IN_PROGRESS and not current.released:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        nap(min(delay, remaining))
        delay = min(delay * 2, cap())
        current = look(current)
    return current
