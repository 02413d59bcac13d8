"""What a relay hands a sink, and what a sink is.

A sink takes one message at a time. Returning normally means the receiver has it (a 2xx, a
broker's acknowledgement): the relay then marks it delivered. Raising means it may or may
not have it: the relay tries again later with the same message id, so receivers dedupe on
the id. :class:`~payorch.errors.DeliveryFailed` carries the receiver's ``retry_after``;
any other exception is a failure too (its type and text are recorded).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

__all__ = ["OutboxMessage", "Sink"]


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


@runtime_checkable
class Sink(Protocol):
    """Delivers outbox messages somewhere (a webhook endpoint, a broker, another system)."""

    def deliver(self, message: OutboxMessage) -> None:
        """Hand ``message`` over; return only once the receiver has it."""

    def close(self) -> None:
        """Release connections (called when the relay stops)."""
