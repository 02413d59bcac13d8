"""What the adapter kit needs from a provider emulator (:class:`Emulator`).

An emulator is a provider-shaped server on loopback that keeps a ledger of effects (so a
test counts money movements, not HTTP answers), honours idempotency keys, injects faults on
demand and signs webhook deliveries the way the provider does. The kit drives an adapter
against one; payorch's own implement it (``payorch.providers.sandbox.emulator``,
``payorch.providers.stripe.emulator``, ``payorch.providers.adyen.emulator``).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ..provider import Provider

__all__ = ["Delivery", "Emulator", "Fault"]


class Fault(enum.StrEnum):
    """A fault the next submission meets, and what the adapter must make of it."""

    RATE_LIMITED = "rate_limited"  # refused before anything was done (429): not sent
    IN_FLIGHT = "in_flight"  # "a request with this key is being processed" (409/704)
    ERROR_BEFORE_COMMIT = "error_before_commit"  # 5xx, nothing done: possibly sent
    ERROR_AFTER_COMMIT = "error_after_commit"  # the effect made, then a 5xx: possibly sent
    DROP_AFTER_COMMIT = "drop_after_commit"  # the effect made, the connection closed unanswered
    DECLINE = "decline"  # a final decline: no effect, and the same key declines again


# A webhook delivery as the provider would POST it: headers and body bytes.
Delivery = tuple[Mapping[str, str], bytes]


@runtime_checkable
class Emulator(Protocol):
    """A provider emulator the kit can drive; see the module docstring."""

    @property
    def faults(self) -> frozenset[Fault]:
        """The faults :meth:`inject` can make; a check needing another fails, naming it."""
        ...

    @property
    def batches(self) -> bool:
        """Whether one delivery may carry several events."""
        ...

    def adapter(self) -> Provider:
        """An adapter pointed at this emulator (webhook secret, account and all)."""
        ...

    def unreachable_adapter(self) -> Provider:
        """The same adapter pointed at a loopback port nothing listens on."""
        ...

    def payload(self, operation: str, **overrides: Any) -> dict[str, Any]:
        """A valid request payload of ``operation`` (``payment.create`` at least)."""
        ...

    def inject(self, fault: Fault) -> None:
        """The next submission meets ``fault``."""
        ...

    def effects(self, downstream_key: str) -> int:
        """Effects made under ``downstream_key``: 1 after any number of replays."""
        ...

    def voided(self, downstream_key: str) -> bool:
        """Whether what ``downstream_key`` authorised was voided (or can no longer charge)."""
        ...

    def delivery(
        self, downstream_keys: Sequence[str], *, tampered: Collection[int] = ()
    ) -> Delivery:
        """One signed delivery of the events that report each key's effect, in this order
        (one key only, where the provider does not batch); the items at ``tampered`` altered
        after signing."""
        ...
