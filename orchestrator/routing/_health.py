"""Providers' health as this process saw their recent calls (no I/O).

A provider whose recent calls mostly failed (certainly not sent, or no answer) is passed
over for new operations for a while, then tried again. Kept per process: each executor
judges what it saw; nothing is stored.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from ..errors import ConfigurationError
from ..forks import reset_in_child
from ..provider import AnswerKind

__all__ = ["Health", "HealthPolicy"]

# What says the provider is failing: nothing got through, or nothing came back.
_FAILED = frozenset({AnswerKind.NOT_SENT, AnswerKind.AMBIGUOUS})


@dataclass(frozen=True, kw_only=True)
class HealthPolicy:
    """A provider whose last ``calls`` calls (those within ``window``), at least
    ``min_calls`` of them, failed in a ratio of ``failure_ratio`` or more is passed over for
    new operations for ``cool_off``, then judged afresh."""

    window: timedelta = timedelta(seconds=60)
    calls: int = 10
    min_calls: int = 5
    failure_ratio: float = 0.5
    cool_off: timedelta = timedelta(seconds=30)

    def __post_init__(self) -> None:
        if (
            self.window <= timedelta(0)
            or self.cool_off < timedelta(0)
            or not 1 <= self.min_calls <= self.calls
            or not 0 < self.failure_ratio <= 1
        ):
            raise ConfigurationError(
                "routing health: need a positive window, cool_off >= 0, "
                "1 <= min_calls <= calls and 0 < failure_ratio <= 1"
            )


class Health:
    """Each provider's recent calls, and until when it is passed over."""

    def __init__(
        self, policy: HealthPolicy, *, clock: Callable[[], float] | None = None, on: bool = True
    ) -> None:
        self.policy = policy
        self.on = on
        self._clock = clock or time.monotonic
        self._start()
        reset_in_child(self, Health._start)  # a forked child judges its own calls

    def _start(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, deque[tuple[float, bool]]] = {}
        self._down_until: dict[str, float] = {}

    def observe(self, provider: str, kind: AnswerKind) -> None:
        """One call to ``provider`` answered ``kind``."""
        if not self.on:
            return
        now = self._clock()
        window = self.policy.window.total_seconds()
        with self._lock:
            calls = self._calls.setdefault(provider, deque(maxlen=self.policy.calls))
            calls.append((now, kind in _FAILED))
            while calls and calls[0][0] < now - window:
                calls.popleft()
            failed = sum(1 for _, bad in calls if bad)
            if len(calls) >= self.policy.min_calls and failed >= self.policy.failure_ratio * len(
                calls
            ):
                self._down_until[provider] = now + self.policy.cool_off.total_seconds()
                calls.clear()  # after the cool-off it is judged afresh

    def healthy(self, provider: str) -> bool:
        if not self.on:
            return True
        with self._lock:
            until = self._down_until.get(provider)
            if until is None:
                return True
            if self._clock() >= until:
                del self._down_until[provider]
                return True
            return False

    def unhealthy(self) -> list[str]:
        """The providers passed over now."""
        return [p for p in list(self._down_until) if not self.healthy(p)]
