"""The relay: lease due outbox messages, hand each to its destination's sink, mark it.

At least once, never "exactly": a message is marked delivered only after its sink returned,
so a relay killed between the two delivers it again once its lease expires (receivers
dedupe on the message id, ``webhook-id`` for webhooks). A failed attempt waits a full-jitter
exponential backoff (at least the receiver's ``retry_after``) and the message is
dead-lettered after ``max_attempts``: visible to ``payorch outbox dead``, never retried
without bound. Several relays share the work: each leases its own rows (``SKIP LOCKED``).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy.engine import Engine

from ..core import backoff_delay, safe_text
from ..errors import ConfigurationError, DeliveryFailed, StorageError
from ..observing import _metrics as metrics
from . import _queue as queue
from ._sinks import OutboxMessage, Sink

__all__ = ["Relay", "RelayPolicy", "RelayReport"]

_log = logging.getLogger("payorch.outbox")


@dataclass(frozen=True)
class RelayPolicy:
    """How a relay works. ``lease`` must outlast a batch's deliveries (``batch_size`` /
    ``concurrency`` of them in a row, each bounded by its sink's deadline): a lease that
    expires mid-delivery lets another relay send the message too (harmless, but a
    duplicate). Backoff: full jitter in ``[retry_after, min(cap, base * 2**attempt)]``."""

    batch_size: int = 50
    lease: timedelta = timedelta(seconds=300)
    max_attempts: int = 12
    backoff_base: float = 2.0
    backoff_cap: float = 3600.0
    concurrency: int = 4
    max_batches: int = 100  # per drain(): a bound on one pass, whatever the backlog

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.concurrency < 1 or self.max_batches < 1:
            raise ConfigurationError("the relay's batch_size, concurrency and max_batches are ≥ 1")
        if self.max_attempts < 1:
            raise ConfigurationError("the relay's max_attempts is ≥ 1")
        if self.lease <= timedelta(0) or self.backoff_base <= 0 or self.backoff_cap <= 0:
            raise ConfigurationError("the relay's lease and backoff are positive")


@dataclass
class RelayReport:
    """What one pass did: messages leased, delivered, failed (to be tried again), dead
    (dead-lettered now), lost (the lease went to another relay before the mark, or the mark
    failed) and released (handed back unsent, the relay stopping)."""

    leased: int = 0
    delivered: int = 0
    failed: int = 0
    dead: int = 0
    lost: int = 0
    released: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, other: RelayReport) -> None:
        for name in ("leased", "delivered", "failed", "dead", "lost", "released"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.errors.extend(other.errors)


class Relay:
    """Delivers the outbox of ``store`` (a :class:`~payorch.Store`, or anything with an
    ``engine``) to ``sinks``, by destination name; messages for other destinations are left
    to the relays that have them."""

    def __init__(
        self,
        store: Any,
        sinks: Mapping[str, Sink],
        *,
        policy: RelayPolicy | None = None,
        owner: str | None = None,
        tenant_ids: Collection[str] | None = None,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if not sinks:
            raise ConfigurationError("a relay needs at least one sink")
        for name, sink in sinks.items():
            if not callable(getattr(sink, "deliver", None)):
                raise ConfigurationError(f"sink {name!r} has no deliver(message) method")
        self.engine: Engine = getattr(store, "engine", store)
        self.sinks = dict(sinks)
        self.policy = policy or RelayPolicy()
        # Unique per relay, even two in one process: a failure is recorded only under the
        # lease (owner and attempt) it was leased with.
        self.owner = owner or f"relay:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.tenant_ids = frozenset(tenant_ids) if tenant_ids is not None else None
        self._rand = rand
        self._stop: threading.Event | None = None  # drain()'s: checked before each message
        self._pool = (
            ThreadPoolExecutor(self.policy.concurrency, thread_name_prefix="payorch-relay")
            if self.policy.concurrency > 1
            else None
        )
        self._check_lease()

    def _check_lease(self) -> None:
        rounds = -(-self.policy.batch_size // self.policy.concurrency)
        for name, sink in self.sinks.items():
            deadline = getattr(sink, "deadline", None)
            if isinstance(deadline, int | float) and deadline * rounds >= (
                self.policy.lease.total_seconds()
            ):
                raise ConfigurationError(
                    f"the relay's lease ({self.policy.lease.total_seconds():g}s) does not "
                    f"outlast a batch to {name!r} ({rounds} deliveries of up to {deadline:g}s "
                    "in a row): lengthen the lease or shrink batch_size"
                )

    def run_once(self) -> RelayReport:
        """Lease one batch and deliver it; the report of what happened."""
        report = RelayReport()
        leased, report.dead = queue.lease_due(
            self.engine,
            owner=self.owner,
            lease_s=self.policy.lease.total_seconds(),
            limit=self.policy.batch_size,
            destinations=self.sinks,
            max_attempts=self.policy.max_attempts,
            tenant_ids=self.tenant_ids,
        )
        report.leased = len(leased)
        if not leased:
            return report
        # Each message is marked as soon as its sink returned: a relay killed mid-batch
        # delivers again only what it had not marked.
        if self._pool is None or len(leased) == 1:
            done = [self._one(m) for m in leased]
        else:
            done = list(self._pool.map(self._one, leased))
        for one in done:
            report.add(one)
        return report

    def _one(self, message: OutboxMessage) -> RelayReport:
        report = RelayReport()
        stop = self._stop
        if stop is not None and stop.is_set():
            # Stopping: what was leased and not begun goes back at once, not after the lease.
            try:
                if queue.release(self.engine, message, owner=self.owner):
                    report.released += 1
            except StorageError:
                report.lost += 1  # its lease runs out instead
            return report
        self._mark(message, self._deliver(message), report)
        return report

    def drain(self, stop: threading.Event | None = None) -> RelayReport:
        """Batches until nothing is due (at most ``max_batches``, and none begun once
        ``stop`` is set): the daemon's pass."""
        total = RelayReport()
        self._stop = stop
        try:
            for _ in range(self.policy.max_batches):
                if stop is not None and stop.is_set():
                    break
                report = self.run_once()
                total.add(report)
                if report.leased == 0 or (
                    report.leased < self.policy.batch_size and not report.delivered
                ):
                    break
        finally:
            self._stop = None
        return total

    def _deliver(self, message: OutboxMessage) -> tuple[str, float | None] | None:
        """None once the sink has it; else (the error, the receiver's retry_after)."""
        sink = self.sinks[message.destination]
        started = time.perf_counter()
        try:
            sink.deliver(message)
        except DeliveryFailed as exc:
            result: tuple[str, float | None] | None = (exc.message, exc.retry_after)
        except Exception as exc:  # noqa: BLE001 - a sink's bug is a failed attempt, counted
            result = (f"{type(exc).__name__}: {safe_text(exc)}", None)
        else:
            result = None
        seconds = time.perf_counter() - started
        if result is None:
            metrics.delivery(message.destination, "delivered", seconds)
        else:
            dead = message.attempt >= self.policy.max_attempts
            metrics.delivery(message.destination, "dead" if dead else "failed", seconds)
        return result

    def _mark(
        self, message: OutboxMessage, error: tuple[str, float | None] | None, report: RelayReport
    ) -> None:
        extra = {"message_id": message.id, "tenant_id": message.tenant_id}
        try:
            if error is None:
                # False: no longer pending (an operator's action, or another relay's mark).
                queue.delivered(self.engine, message)
                report.delivered += 1
                return
            text, retry_after = error
            delay = backoff_delay(
                message.attempt,
                base=self.policy.backoff_base,
                cap=self.policy.backoff_cap,
                rand=self._rand,
                # A receiver's Retry-After is untrusted: never past the backoff's cap.
                floor=min(max(0.0, retry_after or 0.0), self.policy.backoff_cap),
            )
            state = queue.failed(
                self.engine,
                message,
                owner=self.owner,
                error=text,
                delay_s=delay,
                max_attempts=self.policy.max_attempts,
            )
        except StorageError as exc:
            # The mark is lost; the lease expires and the message is delivered again.
            _log.warning("outbox mark of %s failed: %s", message.id, exc.message, extra=extra)
            report.lost += 1
            return
        report.errors.append(f"{message.id}: {text}")
        if state is None:
            report.lost += 1
        elif state == "dead":
            report.dead += 1
            _log.error(
                "outbox message %s dead after %d attempts: %s",
                message.id,
                message.attempt,
                text,
                extra=extra,
            )
        else:
            report.failed += 1
            _log.info("outbox message %s attempt %d failed: %s", message.id, message.attempt, text)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for sink in self.sinks.values():
            close = getattr(sink, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
