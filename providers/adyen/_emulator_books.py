"""The Adyen-shaped emulator's books: what an idempotency key holds, the effects made, and
the gate that holds a request in flight (:mod:`payorch.providers.adyen.emulator` keeps them)."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ._emulator_http import Reply

__all__ = ["Gate", "Held", "LedgerEffect", "now"]

_HOLD_LIMIT = 10.0  # seconds a held request waits for its release at most


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


@dataclass
class Held:
    request: tuple[str, Any]  # (path, parsed body): what a repeat must match
    reply: Reply | None = None  # None while the first request is in flight


@dataclass
class LedgerEffect:
    kind: str  # payment, capture, refund, cancel, technical_cancel
    psp: str
    key: str | None
    reference: str | None
    amount: dict[str, Any] | None = None
    status: str = "received"  # payments: authorised, captured, refused, cancelled
    payment: str | None = None  # a modification's payment pspReference
    captured: int = 0
    refunded: int = 0
    # When it was made: a settlement row's Creation Date.
    created: datetime = dataclasses.field(default_factory=lambda: datetime.now(UTC))


class Gate:
    """Holds one POST in flight after it claimed its key, until :meth:`release`."""

    def __init__(self) -> None:
        self._held = threading.Event()
        self._released = threading.Event()

    def wait_held(self, timeout: float = 5.0) -> bool:
        """Whether a request is being held (waits at most ``timeout`` seconds)."""
        return self._held.wait(timeout)

    def release(self) -> None:
        self._released.set()

    def _hold(self) -> None:
        self._held.set()
        self._released.wait(_HOLD_LIMIT)
