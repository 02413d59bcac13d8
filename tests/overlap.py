"""Concurrent workers made to overlap on purpose, for tests of work shared between them.

A test that two reconcilers never check an operation twice proves something only while both
hold work at once; whether they do should not depend on how a loaded machine schedules
them. :class:`Overlap` holds each worker's provider calls until every worker has one in
flight, bounded by ``hold`` from the first call. In-process workers call ``arrive`` before
each provider call; workers in other processes reach the sandbox through an
:class:`OverlapProxy` each, which holds their requests on the wire.

A test asserts on outcomes (states, status queries, effects at the sandbox); it may assert
``met`` only when its hold cannot run into a time-out of the workers (in-process, before the
HTTP call), never when the workers are other processes.
"""

from __future__ import annotations

import threading
import time
from typing import Any
from urllib.parse import urlsplit

from pgproxy import LoopbackProxy

__all__ = ["Overlap", "OverlapProxy"]


class Overlap:
    """A meeting point for ``parties`` named workers."""

    def __init__(self, parties: int, *, hold: float) -> None:
        self.parties = parties
        self.hold = hold
        self._cond = threading.Condition()
        self._arrived: set[str] = set()
        self._until: float | None = None  # the first arrival + hold
        self.met = False  # every party had a call in flight at the same time

    def arrive(self, party: str) -> None:
        """Before a call of ``party``: wait until every party has arrived, or the hold is
        over (then nobody waits any more)."""
        with self._cond:
            self._arrived.add(party)
            if len(self._arrived) == self.parties:
                self.met = True
                self._cond.notify_all()
            if self._until is None:
                self._until = time.monotonic() + self.hold
            self._cond.wait_for(lambda: self.met, max(0.0, self._until - time.monotonic()))


class OverlapProxy(LoopbackProxy):
    """One worker's way to an HTTP server on 127.0.0.1 (the sandbox): each request it sends
    arrives at ``overlap`` first."""

    def __init__(self, target_url: str, overlap: Overlap, party: str) -> None:
        target = urlsplit(target_url)
        assert target.hostname is not None and target.port is not None, target_url
        super().__init__(target.hostname, target.port)
        self.overlap = overlap
        self.party = party
        self.http_url = f"http://127.0.0.1:{self.port}"

    def on_client(self, flow: dict[str, Any], data: bytes) -> None:
        self.overlap.arrive(self.party)
