"""The sandbox's books: a movable clock, the ledger of effects and the idempotency store."""

from __future__ import annotations

import copy
import enum
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Claim",
    "Clock",
    "EffectStatus",
    "IdempotencyStore",
    "Ledger",
    "StoredResponse",
    "VoidResult",
]


class Clock:
    """Real time plus an offset that tests move forward instead of sleeping."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offset = 0.0

    def advance(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError("the sandbox clock only moves forward by a finite amount")
        with self._lock:
            self._offset += seconds

    @property
    def offset(self) -> float:
        with self._lock:
            return self._offset

    def monotonic(self) -> float:
        """For windows, lags and settling: never goes back."""
        return time.monotonic() + self.offset

    def wall(self) -> float:
        """For ``created`` fields: epoch seconds as the provider sees them."""
        return time.time() + self.offset


class EffectStatus(enum.StrEnum):
    SUCCEEDED = "succeeded"
    DECLINED = "declined"
    PROCESSING = "processing"
    VOIDED = "voided"  # an authorisation released before capture


class VoidResult(enum.StrEnum):
    VOIDED = "voided"  # released now, or it was already
    NOTHING_FOUND = "nothing_found"  # no effect under the key; the key can no longer charge
    ALREADY_CAPTURED = "already_captured"  # money moved: refund it instead


@dataclass
class _Entry:
    data: dict[str, Any]
    committed_at: float  # server monotonic clock
    settle_at: float | None  # for "processing" entries
    seq: int = 0  # commit order


class Ledger:
    """Every effect the acquirer committed, in commit order. Thread-safe.

    ``on_change`` gets a copy of an effect each time one is committed or changes status; it
    is called under the ledger lock so events come out in the order the changes happened.
    """

    def __init__(
        self,
        clock: Clock,
        *,
        settle_after: float,
        on_change: Callable[[dict[str, Any]], object] | None = None,
    ) -> None:
        self._clock = clock
        self._settle_after = settle_after
        self._on_change = on_change
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}  # insertion-ordered: commit order
        self._processing: set[str] = set()  # so settle_due() does not scan the whole ledger
        # Lookups by idempotency key and by metadata payorch_ref (a status query's search)
        # read these instead of scanning every effect: a provider's search is indexed.
        self._by_key: dict[str, list[str]] = {}
        self._by_ref: dict[str, list[str]] = {}
        # Keys voided before anything was made under them: a late request under one is
        # refused, so a void by key holds even when it overtakes the payment it voids.
        self._voided_keys: set[str] = set()

    def commit(
        self,
        *,
        operation: str,
        idempotency_key: str,
        payload: dict[str, Any],
        status: EffectStatus,
    ) -> dict[str, Any] | None:
        """The effect committed, or None when ``idempotency_key`` was voided first."""
        now = self._clock.monotonic()
        metadata = payload.get("metadata")
        data: dict[str, Any] = {
            "id": f"sbx_{secrets.token_hex(12)}",
            "object": "effect",
            "status": status.value,
            "operation": operation,
            "amount": payload.get("amount"),
            "currency": payload.get("currency"),
            "idempotency_key": idempotency_key,
            "metadata": copy.deepcopy(metadata) if isinstance(metadata, dict) else {},
            "created": int(self._clock.wall()),
        }
        if payload.get("capture_method") == "manual":
            data["capture_method"] = "manual"
        for name in ("payment_intent", "amount_to_capture"):  # a capture's or a refund's
            if payload.get(name) is not None:
                data[name] = payload[name]
        if status is EffectStatus.DECLINED:
            data["failure_code"] = "card_declined"
            data["decline_code"] = "generic_decline"
        settle_at = now + self._settle_after if status is EffectStatus.PROCESSING else None
        with self._lock:
            if idempotency_key in self._voided_keys:
                return None
            entry = _Entry(data=data, committed_at=now, settle_at=settle_at, seq=len(self._entries))
            self._entries[data["id"]] = entry
            self._by_key.setdefault(idempotency_key, []).append(data["id"])
            ref = data["metadata"].get("payorch_ref")
            if isinstance(ref, str):
                self._by_ref.setdefault(ref, []).append(data["id"])
            if settle_at is not None:
                self._processing.add(data["id"])
            self._changed_locked(data)
            return copy.deepcopy(data)

    def settle(self, effect_id: str, outcome: EffectStatus) -> dict[str, Any]:
        """Finish a "processing" effect now; a no-op if it already has that outcome."""
        if outcome is EffectStatus.PROCESSING:
            raise ValueError("settle to succeeded or declined")
        with self._lock:
            entry = self._entries.get(effect_id)
            if entry is None:
                raise KeyError(effect_id)
            current = entry.data["status"]
            if current == outcome.value:
                return copy.deepcopy(entry.data)
            if current != EffectStatus.PROCESSING.value:
                raise ValueError(f"effect {effect_id} is already {current}")
            self._finish_locked(entry, outcome)
            return copy.deepcopy(entry.data)

    def overturn(self, effect_id: str) -> dict[str, Any]:
        """A declined effect approved after all (an issuer's stand-in approval that arrives
        late): it is succeeded now, and its money moved."""
        with self._lock:
            entry = self._entries.get(effect_id)
            if entry is None:
                raise KeyError(effect_id)
            if entry.data["status"] != EffectStatus.DECLINED.value:
                raise ValueError(f"effect {effect_id} is {entry.data['status']}, not declined")
            entry.data.pop("failure_code", None)
            entry.data.pop("decline_code", None)
            entry.data["status"] = EffectStatus.SUCCEEDED.value
            self._changed_locked(entry.data)
            return copy.deepcopy(entry.data)

    def void(self, idempotency_key: str) -> tuple[VoidResult, dict[str, Any] | None]:
        """Release the uncaptured authorisation made under ``idempotency_key``.

        Nothing made under it yet: the key is voided, so nothing can be made under it later.
        A declined effect holds nothing: void as it stands. A captured one cannot be voided.
        """
        self.settle_due()
        with self._lock:
            ids = self._by_key.get(idempotency_key)
            if not ids:
                self._voided_keys.add(idempotency_key)
                return VoidResult.NOTHING_FOUND, None
            entry = self._entries[ids[-1]]
            status = entry.data["status"]
            manual = entry.data.get("capture_method") == "manual"
            if status == EffectStatus.SUCCEEDED.value and not manual:
                return VoidResult.ALREADY_CAPTURED, copy.deepcopy(entry.data)
            if status in (EffectStatus.SUCCEEDED.value, EffectStatus.PROCESSING.value):
                entry.settle_at = None
                self._processing.discard(entry.data["id"])
                entry.data["status"] = EffectStatus.VOIDED.value
                self._changed_locked(entry.data)
            return VoidResult.VOIDED, copy.deepcopy(entry.data)

    def settle_due(self) -> None:
        """Settle every "processing" effect whose time has come (evaluated lazily, on reads)."""
        now = self._clock.monotonic()
        with self._lock:
            due = [
                entry
                for entry in map(self._entries.__getitem__, self._processing)
                if entry.settle_at is not None and entry.settle_at <= now
            ]
            # Commit order, so their events come out in a stable order.
            for entry in sorted(due, key=lambda e: e.committed_at):
                self._finish_locked(entry, EffectStatus.SUCCEEDED)

    def entries(self) -> list[dict[str, Any]]:
        """The whole ledger, lag ignored: the truth tests count."""
        self.settle_due()
        with self._lock:
            return [copy.deepcopy(e.data) for e in self._entries.values()]

    def visible(self, *, lag: float) -> list[dict[str, Any]]:
        """Effects at least ``lag`` seconds old: the read side."""
        self.settle_due()
        horizon = self._clock.monotonic() - lag
        with self._lock:
            return [
                copy.deepcopy(e.data) for e in self._entries.values() if e.committed_at <= horizon
            ]

    def search(
        self,
        *,
        lag: float,
        idempotency_keys: list[str] | None = None,
        refs: list[str] | None = None,
    ) -> list[dict[str, Any]]:
        """Visible effects with one of ``idempotency_keys`` and (AND) one of ``refs``
        (metadata ``payorch_ref``; a filter that is None matches all), in commit order."""
        if idempotency_keys is None and refs is None:
            return self.visible(lag=lag)
        self.settle_due()
        horizon = self._clock.monotonic() - lag
        with self._lock:
            found: set[str] | None = None
            for index, wanted in (
                (self._by_key, idempotency_keys),
                (self._by_ref, refs),
            ):
                if wanted is not None:
                    ids = {effect for value in wanted for effect in index.get(value, ())}
                    found = ids if found is None else found & ids
            entries = sorted((self._entries[i] for i in found or ()), key=lambda e: e.seq)
            return [copy.deepcopy(e.data) for e in entries if e.committed_at <= horizon]

    def listing(
        self,
        *,
        lag: float,
        created_gte: int | None = None,
        created_lte: int | None = None,
        limit: int = 100,
        starting_after: str | None = None,
    ) -> tuple[list[dict[str, Any]], bool]:
        """One page of visible effects, in commit order, whose ``created`` lies in the range:
        at most ``limit`` after the effect ``starting_after``, and whether more follow
        (Stripe's list pagination). KeyError: no effect ``starting_after``."""
        self.settle_due()
        horizon = self._clock.monotonic() - lag
        with self._lock:
            after = self._entries[starting_after] if starting_after is not None else None
            found: list[dict[str, Any]] = []
            for entry in self._entries.values():
                if after is not None and entry.seq <= after.seq:
                    continue
                created = entry.data["created"]
                if entry.committed_at > horizon or (
                    (created_gte is not None and created < created_gte)
                    or (created_lte is not None and created > created_lte)
                ):
                    continue
                if len(found) == limit:
                    return found, True
                found.append(copy.deepcopy(entry.data))
            return found, False

    def get(self, effect_id: str, *, lag: float) -> dict[str, Any] | None:
        """One effect if it is at least ``lag`` seconds old."""
        self.settle_due()
        horizon = self._clock.monotonic() - lag
        with self._lock:
            entry = self._entries.get(effect_id)
            if entry is None or entry.committed_at > horizon:
                return None
            return copy.deepcopy(entry.data)

    def _finish_locked(self, entry: _Entry, outcome: EffectStatus) -> None:
        entry.settle_at = None
        self._processing.discard(entry.data["id"])
        entry.data["status"] = outcome.value
        if outcome is EffectStatus.DECLINED:
            entry.data["failure_code"] = "card_declined"
            entry.data["decline_code"] = "generic_decline"
        self._changed_locked(entry.data)

    def _changed_locked(self, data: dict[str, Any]) -> None:
        if self._on_change is not None:
            self._on_change(copy.deepcopy(data))


class Claim(enum.Enum):
    NEW = "new"  # the caller now owns the key and must complete() or release() it
    REPLAY = "replay"  # a stored response for the same request
    MISMATCH = "mismatch"  # the key was used for another request
    IN_PROGRESS = "in_progress"  # the same request is being executed right now


@dataclass(frozen=True)
class StoredResponse:
    fingerprint: str
    status: int
    body: bytes
    stored_at: float  # server monotonic clock


class IdempotencyStore:
    """Idempotency-Key -> stored response for ``window`` seconds, plus keys in flight.

    The check and the claim happen under one lock, so two concurrent requests with one key
    never both execute.
    """

    def __init__(self, clock: Clock, *, window: float) -> None:
        self._clock = clock
        self._window = window
        self._lock = threading.Lock()
        self._stored: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._in_flight: dict[str, str] = {}  # key -> fingerprint

    def claim(self, key: str, fingerprint: str) -> tuple[Claim, StoredResponse | None]:
        with self._lock:
            self._expire_locked()
            stored = self._stored.get(key)
            if stored is not None:
                if stored.fingerprint != fingerprint:
                    return Claim.MISMATCH, stored
                return Claim.REPLAY, stored
            in_flight = self._in_flight.get(key)
            if in_flight is not None:
                return (Claim.MISMATCH if in_flight != fingerprint else Claim.IN_PROGRESS), None
            self._in_flight[key] = fingerprint
            return Claim.NEW, None

    def complete(self, key: str, fingerprint: str, status: int, body: bytes) -> None:
        """Store the response of a committed request and free the key."""
        with self._lock:
            self._in_flight.pop(key, None)
            self._stored[key] = StoredResponse(
                fingerprint=fingerprint,
                status=status,
                body=body,
                stored_at=self._clock.monotonic(),
            )
            self._stored.move_to_end(key)

    def in_flight(self, key: str) -> bool:
        """Whether a request under ``key`` is being executed right now."""
        with self._lock:
            return key in self._in_flight

    def release(self, key: str) -> None:
        """Free a claimed key without storing anything (the request did not commit)."""
        with self._lock:
            self._in_flight.pop(key, None)

    def _expire_locked(self) -> None:
        # The clock never goes back, so the oldest entries are at the front: stop at the
        # first one still inside the window. Bounded by the number of stored keys.
        horizon = self._clock.monotonic() - self._window
        while self._stored:
            key, oldest = next(iter(self._stored.items()))
            if oldest.stored_at > horizon:
                break
            del self._stored[key]
