"""What a relay hands a sink, and what a sink is.

A sink takes one message at a time. Returning normally means the receiver has it (a 2xx, a
broker's acknowledgement): the relay then marks it delivered. Raising means it may or may
not have it: the relay tries again later with the same message id, so receivers dedupe on
the id. :class:`~payorch.errors.DeliveryFailed` carries the receiver's ``retry_after``;
any other exception is a failure too (its type and text are recorded).

A time a sink stamps on a delivery (a webhook's signed ``webhook-timestamp``) comes from
:meth:`OutboxMessage.now`: the database's clock as the relay read it with the lease, carried
forward by the relay host's monotonic clock, so a relay on a host whose wall clock is off
still stamps the time its receivers judge it by.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, runtime_checkable

__all__ = ["LeaseClock", "OutboxMessage", "Sink"]


@dataclass(frozen=True, slots=True)
class LeaseClock:
    """The database's time when a relay leased a batch (``database_time``) and the relay
    host's monotonic clock then (``monotonic``): :meth:`now` is the database's time now, as
    the monotonic clock counts the time since. It never reads the host's wall clock, which
    may be minutes off (and may jump); the monotonic clock only counts seconds, and over a
    batch (bounded by the lease) its rate error is far below a second."""

    database_time: datetime
    monotonic: float

    def now(self) -> datetime:
        elapsed = max(0.0, time.monotonic() - self.monotonic)
        return self.database_time + timedelta(seconds=elapsed)


@dataclass(frozen=True, slots=True)
class OutboxMessage:
    """A staged message as the relay reads it. ``attempt`` counts this delivery (1 the
    first time); ``operation_id`` is the operation whose outcome staged it, if any."""

    tenant_id: str
    id: str
    type: str
    aggregate_type: str
    aggregate_id: str
    payload: Mapping[str, Any]
    destination: str
    attempt: int
    operation_id: str | None
    created_at: datetime
    # Set by the relay that leased it; not part of what the message is.
    clock: LeaseClock | None = field(default=None, repr=False, compare=False)

    def now(self) -> datetime:
        """The time to stamp this delivery with (a signature's timestamp): the database's,
        carried forward from the relay's lease; the host's wall clock only for a message no
        relay leased (one built by hand)."""
        return self.clock.now() if self.clock is not None else datetime.now(UTC)


@runtime_checkable
class Sink(Protocol):
    """Delivers outbox messages somewhere (a webhook endpoint, a broker, another system)."""

    def deliver(self, message: OutboxMessage) -> None:
        """Hand ``message`` over; return only once the receiver has it."""

    def close(self) -> None:
        """Release connections (called when the relay stops)."""
