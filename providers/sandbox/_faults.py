"""Fault injection for the sandbox acquirer: which fault a request gets, and in what order.

A fault comes from the ``X-Sandbox-Fault`` header, else from the queue filled by
:meth:`FaultPlan.inject`, else from seeded per-fault rates. The rates draw from one
``random.Random(seed)`` under a lock, so a sequential run is reproducible from its seed.
The plan also holds the base latency every request gets (fixed plus jitter), drawn from a
second seeded stream. docs/sandbox.md describes each fault as a client sees it.
"""

from __future__ import annotations

import enum
import math
import random
import threading
from collections import deque
from collections.abc import Mapping

__all__ = [
    "AFTER_COMMIT",
    "ALIASES",
    "BEFORE_COMMIT",
    "WIRE_FAULTS",
    "Fault",
    "FaultPlan",
    "parse_fault",
]

LATENCY_RANGE = (0.05, 0.30)  # seconds
FAULT_LOG_LIMIT = 10_000  # entries kept by FaultPlan.log()


class Fault(enum.StrEnum):
    LATENCY = "latency"  # delay the request, then answer normally
    DECLINE = "decline"  # record a declined effect, answer 402
    ERROR_500_BEFORE = "error_500_before"  # 500, nothing committed
    ERROR_500_AFTER = "error_500_after"  # commit, then answer 500
    DROP_AFTER = "drop_after"  # commit, then hold the connection without answering
    RESET_AFTER = "reset_after"  # commit, then reset the connection (RST)
    RATE_LIMIT = "rate_limit"  # 429 + Retry-After, nothing committed
    PENDING = "pending"  # commit as "processing"; it settles later
    # Commit, then send the headers at once and the body one byte per trickle interval:
    # every gap is shorter than a read time-out, the whole far longer than a call deadline.
    TRICKLE = "trickle"


# Faults that stop a request before the idempotency store or the ledger see it.
BEFORE_COMMIT = frozenset({Fault.RATE_LIMIT, Fault.ERROR_500_BEFORE})
# Faults that hit the response on the wire: they apply to replays too.
AFTER_COMMIT = frozenset(
    {Fault.ERROR_500_AFTER, Fault.DROP_AFTER, Fault.RESET_AFTER, Fault.TRICKLE}
)
# Faults acted out by the server on the socket instead of a plain answer.
WIRE_FAULTS = frozenset({Fault.DROP_AFTER, Fault.RESET_AFTER, Fault.TRICKLE})


# Other names a tester reaches for first: a "timeout" is an answer that never comes.
ALIASES = {"timeout": Fault.DROP_AFTER}


def parse_fault(value: str) -> Fault:
    """The fault named ``value`` (case and surrounding blanks ignored; the names in
    ``ALIASES`` too); ValueError if unknown."""
    name = value.strip().lower()
    if name in ALIASES:
        return ALIASES[name]
    try:
        return Fault(name)
    except ValueError:
        known = ", ".join([*(f.value for f in Fault), *ALIASES])
        raise ValueError(f"unknown fault {value!r}; known: {known}") from None


def _validated_rates(rates: Mapping[str, float] | None) -> tuple[tuple[Fault, float], ...]:
    if not rates:
        return ()
    parsed: dict[Fault, float] = {}
    for name, rate in rates.items():
        fault = parse_fault(name)
        if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
            raise ValueError(f"fault rate for {fault.value} must be within [0, 1], got {rate!r}")
        parsed[fault] = float(rate)
    if sum(parsed.values()) > 1.0 + 1e-9:
        raise ValueError("fault rates must add up to at most 1")
    # Declaration order, not mapping order, so the same rates give the same draws.
    return tuple((f, parsed[f]) for f in Fault if parsed.get(f, 0.0) > 0.0)


class FaultPlan:
    """Decides the fault of each POST: header > injected queue > seeded rates."""

    def __init__(
        self,
        rates: Mapping[str, float] | None = None,
        *,
        seed: int = 0,
        latency: float = 0.0,
        jitter: float = 0.0,
    ) -> None:
        for name, value in (("latency", latency), ("jitter", jitter)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite, non-negative number of seconds")
        self._rates = _validated_rates(rates)
        self._latency = float(latency)
        self._jitter = float(jitter)
        self._lock = threading.Lock()
        # Not for security: a seeded stream is the point (reproducible fault runs).
        self._rng = random.Random(seed)  # noqa: S311
        # A separate stream for delays, so whether a latency fault was drawn does not shift
        # the fault sequence of later requests.
        self._delay_rng = random.Random(seed + 1)  # noqa: S311
        self._queue: deque[Fault] = deque()
        self._log: deque[Fault | None] = deque(maxlen=FAULT_LOG_LIMIT)

    def inject(self, fault: Fault | str, times: int = 1) -> None:
        parsed = fault if isinstance(fault, Fault) else parse_fault(fault)
        if times < 1:
            raise ValueError("times must be at least 1")
        with self._lock:
            self._queue.extend([parsed] * times)

    def rates(self) -> dict[Fault, float]:
        """The per-fault rates in force (faults with a zero rate left out)."""
        return dict(self._rates)

    @property
    def base_latency(self) -> tuple[float, float]:
        """(fixed, jitter) seconds every request waits before it is handled."""
        return self._latency, self._jitter

    def request_delay(self) -> float:
        """The base delay of one request: the fixed latency plus a uniform jitter draw."""
        if not self._jitter:
            return self._latency  # no draw: the latency faults' stream stays as without
        with self._lock:
            return self._latency + self._delay_rng.uniform(0.0, self._jitter)

    def queued(self) -> list[Fault]:
        with self._lock:
            return list(self._queue)

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()

    def next_for_post(self, forced: Fault | None) -> Fault | None:
        """The fault for the next POST, consuming the queue or the RNG as needed."""
        with self._lock:
            # Draw on every POST when rates are set, even if the header or the queue wins,
            # so the n-th POST always gets the n-th draw.
            drawn = self._draw_locked() if self._rates else None
            if forced is not None:
                fault: Fault | None = forced
            elif self._queue:
                fault = self._queue.popleft()
            else:
                fault = drawn
            self._log.append(fault)
            return fault

    def latency_seconds(self) -> float:
        with self._lock:
            return self._delay_rng.uniform(*LATENCY_RANGE)

    def log(self) -> list[Fault | None]:
        """The fault (or None) of each POST so far, oldest first (bounded)."""
        with self._lock:
            return list(self._log)

    def _draw_locked(self) -> Fault | None:
        point = self._rng.random()
        cumulative = 0.0
        for fault, rate in self._rates:
            cumulative += rate
            if point < cumulative:
                return fault
        return None
