"""One trip to the database for identical requests that arrive together in one process.

When requests with one namespace and one fingerprint meet in one process (a storm of a
client's duplicates), the first *leads*: it claims and executes (or finds) the operation as
usual. Those that come while it is under way and may wait (``wait=``) *join* it instead of
each claiming, reading and waiting on the database, which would slow the leader and each
other: when the leader has its answer they answer with it, a replay if it is settled (their
replays counted by one statement). A joiner whose leader ends in an error, or whose own
wait runs out first, takes the usual path itself, so its answer is never other than the
database's, except when the leader found the provider unreachable (``ProviderUnavailable``:
nothing was sent, nothing stored): its joiners get that answer too, rather than each
running the same inline retries against a provider that is refusing. Nothing here calls a
provider.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ..core import State
from ..errors import ProviderUnavailable
from ..forks import reset_in_child
from ..records import OperationRecord

__all__ = ["Flight", "Flights", "Namespace"]

Namespace = tuple[str, str, str]  # tenant, operation, idempotency key


@dataclass
class Flight:
    fingerprint: str
    landed: threading.Event = field(default_factory=threading.Event)
    record: OperationRecord | None = None  # the leader's answer; None: it raised
    unavailable: ProviderUnavailable | None = None  # what it raised, when it is shared
    joined: int = 0  # joiners that will answer from ``record`` (their replays)
    uncounted: int = 0  # replays still to count: taken by the first joiner to wake


class Flights:
    def __init__(self) -> None:
        self._start()
        reset_in_child(self, Flights._start)  # a forked child's flights have no leaders

    def _start(self) -> None:
        self._lock = threading.Condition()
        self._flying: dict[Namespace, Flight] = {}

    def lead_or_join(
        self, namespace: Namespace, fingerprint: str, *, may_join: bool
    ) -> tuple[Flight | None, bool]:
        """``(flight, True)``: lead it (then :meth:`land` it); ``(flight, False)``: joined
        (then :meth:`wait`); ``(None, False)``: take the usual path alone."""
        with self._lock:
            flight = self._flying.get(namespace)
            if flight is None:
                flight = self._flying[namespace] = Flight(fingerprint)
                return flight, True
            if may_join and flight.fingerprint == fingerprint:
                flight.joined += 1
                self._lock.notify_all()
                return flight, False
            return None, False

    def land(
        self,
        namespace: Namespace,
        flight: Flight,
        record: OperationRecord | None,
        unavailable: ProviderUnavailable | None = None,
    ) -> None:
        """The leader's answer (None: it raised; ``unavailable`` if that is what it raised):
        its joiners wake; nobody joins any more."""
        with self._lock:
            if self._flying.get(namespace) is flight:
                del self._flying[namespace]
            # Only an answer that is no longer in progress is shared.
            if record is not None and record.state is State.IN_PROGRESS:
                record = None
            flight.record = record
            flight.unavailable = unavailable
            flight.uncounted = flight.joined if record is not None and record.terminal else 0
        flight.landed.set()

    def wait(self, flight: Flight, timeout: float) -> tuple[OperationRecord | None, int]:
        """The leader's answer, or None (the usual path, then); and the replays this joiner
        is to count for everyone (the first to wake counts them all)."""
        deadline = time.monotonic() + timeout
        while not flight.landed.wait(max(0.0, deadline - time.monotonic())):
            with self._lock:
                if not flight.landed.is_set():
                    flight.joined -= 1  # gone before it landed: not counted
                    return None, 0
        with self._lock:
            count, flight.uncounted = flight.uncounted, 0
        return flight.record, count

    def wait_for_joiners(self, count: int, timeout: float) -> bool:
        """Block until ``count`` requests have joined flights (tests, benchmarks)."""
        with self._lock:
            return self._lock.wait_for(
                lambda: sum(f.joined for f in self._flying.values()) >= count, timeout
            )
