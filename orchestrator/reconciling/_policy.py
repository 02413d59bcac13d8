"""What a reconciler is told (its policy) and what one pass reports."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta

from ..errors import ConfigurationError
from ..observing import _metrics as metrics

__all__ = ["DEFAULT_CONCURRENCY", "ReconcileReport", "ReconcilerPolicy"]


@dataclass(frozen=True, kw_only=True)
class ReconcilerPolicy:
    lease: timedelta = timedelta(seconds=60)
    batch_size: int = 50
    not_found_grace: timedelta = timedelta(seconds=60)  # providers are eventually consistent
    # Re-submit only while the provider's key window still covers us, with this margin.
    window_margin: timedelta = timedelta(minutes=10)
    base_delay: float = 2.0
    max_delay: float = 300.0
    max_checks: int = 20
    max_unknown_age: timedelta = timedelta(hours=24)
    # A provider that cannot be asked (webhooks only): wait this long for its notification
    # before replaying the request inside its key window.
    webhook_grace: timedelta = timedelta(minutes=2)
    # Opt-in: void an unknown authorisation (a request with capture_method "manual") of these
    # operation types this long after its claim, instead of leaving money held. None: never.
    void_after: timedelta | None = None
    void_operations: frozenset[str] = frozenset({"payment.create"})
    # Checks of one batch run this many at a time (None: DEFAULT_CONCURRENCY, or the store's
    # pool size if smaller). Each check holds one pooled connection at a time.
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_checks < 1 or self.base_delay <= 0:
            raise ConfigurationError("reconciler policy: batch, checks and delays must be > 0")
        if self.void_after is not None and self.void_after < timedelta(0):
            raise ConfigurationError("reconciler void_after must not be negative")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigurationError(
                f"reconciler concurrency {self.concurrency} must be at least 1"
            )


DEFAULT_CONCURRENCY = 8


@dataclass
class ReconcileReport:
    picked: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    released: int = 0

    def add(self, what: str) -> None:
        self.outcomes[what] += 1
        metrics.checked(what)  # one check's result: the report and the counter agree

    def merge(self, other: ReconcileReport) -> None:
        self.picked += other.picked
        self.outcomes.update(other.outcomes)
        self.released += other.released
