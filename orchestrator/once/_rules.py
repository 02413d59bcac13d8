"""The decisions of payorch.once as plain functions: what a found effect means for a call,
what an exception means for the effect, and the one stored form of payloads and results.

No I/O, no clock (``now`` is the database's, read with the row): the sync and async forms,
the decorator, the consumer and the context manager share these answers.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ..core import State, canonical_digest, check_encodable, safe_text
from ..errors import (
    EffectFailed,
    EffectOutcomeUnknown,
    IdempotencyKeyReused,
    OperationInProgress,
)
from ._values import EffectRecord, EffectResult, Policy

__all__ = [
    "LEASE_EXPIRED",
    "MAX_ERROR_MESSAGE",
    "RERUNNABLE",
    "Kind",
    "Verdict",
    "classify",
    "error_doc",
    "failed",
    "in_progress",
    "judge",
    "payload_fingerprint",
    "replay",
    "rerunnable",
    "reused",
    "storable",
    "unknown",
]

MAX_ERROR_MESSAGE = 2000
_RETRY_CAP = 5.0  # seconds: "in progress" says when to look again, not how long the lease is


class Verdict(enum.Enum):
    """What a call does with the effect it found under its key."""

    REUSED = "reused"  # another fingerprint: refused, nothing runs
    REPLAY = "replay"  # succeeded: the stored result
    FAILED = "failed"  # failed_final: the stored failure, again
    UNKNOWN = "unknown"  # outcome_unknown: escalated, never run again
    IN_PROGRESS = "in_progress"  # a live lease: someone is running it
    TAKE_OVER = "take_over"  # nobody holds it and running it again is safe
    ESCALATE = "escalate"  # a lapsed lease over a run that may have reached the outside


_SETTLED = {
    State.SUCCEEDED: Verdict.REPLAY,
    State.FAILED_FINAL: Verdict.FAILED,
    State.OUTCOME_UNKNOWN: Verdict.UNKNOWN,
}


def judge(record: EffectRecord, fingerprint: str, now: datetime, *, rerun_safe: bool) -> Verdict:
    """The answer for a call with ``fingerprint`` that found ``record`` at database time
    ``now``. ``rerun_safe``: the downstream system dedupes on our key, so a run that may have
    reached it can run again instead of waiting for an operator (never one known to have
    run, as an ``unencodable_result``)."""
    if record.fingerprint != fingerprint:
        return Verdict.REUSED
    if record.state is not State.IN_PROGRESS:
        if rerun_safe and rerunnable(record):
            return Verdict.TAKE_OVER
        return _SETTLED[record.state]
    if record.lease_expires_at is not None and record.lease_expires_at > now:
        return Verdict.IN_PROGRESS
    # Released, or its worker died: a run that never possibly reached the outside (it
    # died before it was marked) is abandoned, not unknown; the next call takes it over.
    if not record.possibly_sent or rerun_safe:
        return Verdict.TAKE_OVER
    return Verdict.ESCALATE


class Kind(enum.Enum):
    """What an exception raised by the effect means."""

    RETRY = "retry"  # retry_on: nothing happened; the same key runs again
    FINAL = "final"  # final_on: recorded, replayed as EffectFailed
    POSSIBLY_SENT = "possibly_sent"  # anything else: it may have happened


LEASE_EXPIRED = "lease_expired"  # error.kind of an effect escalated when its lease lapsed
# Why an effect was escalated, when the only doubt is whether a run reached the outside: a
# downstream system that dedupes on our key (rerun_safe) makes running it again safe.
# Anything else waits for an operator: a result that could not be stored (the effect ran),
# or a kind this code does not know.
RERUNNABLE = frozenset({LEASE_EXPIRED, Kind.POSSIBLY_SENT.value})


def rerunnable(record: EffectRecord) -> bool:
    """An escalated effect whose only doubt is whether it reached the outside."""
    kind = record.error.get("kind") if record.error is not None else None
    return record.state is State.OUTCOME_UNKNOWN and isinstance(kind, str) and kind in RERUNNABLE


def classify(exc: BaseException, policy: Policy) -> Kind:
    """The most specific class wins: the first of the exception's MRO named in either list
    (``retry_on=(OSError,)``, ``final_on=(FileNotFoundError,)`` makes a missing file final)."""
    retry, final = set(policy.retry_on), set(policy.final_on)
    for cls in type(exc).__mro__:
        if cls in final:
            return Kind.FINAL
        if cls in retry:
            return Kind.RETRY
    return Kind.POSSIBLY_SENT


def error_doc(exc: BaseException, kind: Kind | str) -> dict[str, Any]:
    """What is stored of an exception: its class name and message (replayed by
    ``EffectFailed``), never its traceback or arguments."""
    return {
        "kind": kind.value if isinstance(kind, Kind) else kind,
        "type": type(exc).__qualname__,
        "message": safe_text(exc)[:MAX_ERROR_MESSAGE],
    }


def storable(value: Any) -> Any:
    """``value`` as it is stored and as every call gets it back (a tuple comes back a list):
    the first caller sees what the replays will. Raises ``UnencodableRequest``, TypeError or
    ValueError for what JSON cannot carry exactly."""
    check_encodable(value, sets=False)
    return json.loads(json.dumps(value, allow_nan=False, ensure_ascii=False))


_BYTES_TAG = b"payorch-bytes\x00"


def payload_fingerprint(payload: Any) -> str:
    """SHA-256 of a payload: of its RFC 8785 canonical JSON (so key order and number
    spelling do not matter), or of the bytes themselves (tagged: bytes never collide with
    a JSON text). Floats are fine here: a message is not money. ``UnencodableRequest`` for
    what has no canonical form."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return hashlib.sha256(_BYTES_TAG + bytes(payload)).hexdigest()
    check_encodable(payload, "payload", sets=False)
    return canonical_digest(_plain(payload), "payload")


def _plain(value: Any) -> Any:
    # rfc8785 takes dicts and lists only: other mappings and tuples are the same JSON.
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# -- the answers -------------------------------------------------------------------------


def replay(record: EffectRecord) -> EffectResult:
    return EffectResult(
        value=record.result,
        replayed=True,
        effect_id=record.id,
        tenant_id=record.tenant_id,
        namespace=record.namespace,
        key=record.key,
        attempts=record.attempts,
    )


def reused(record: EffectRecord) -> IdempotencyKeyReused:
    return IdempotencyKeyReused(
        f"key {record.key!r} of namespace {record.namespace!r} was first used with another "
        "payload; nothing was run",
        operation_id=record.id,
    )


def failed(record: EffectRecord) -> EffectFailed:
    error = record.error or {}
    return EffectFailed(
        f"effect {record.id} failed for good: {error.get('message', '')}".rstrip(": "),
        effect_id=record.id,
        error_type=str(error.get("type", "unknown")),
        error_message=str(error.get("message", "")),
    )


def unknown(record: EffectRecord) -> EffectOutcomeUnknown:
    return EffectOutcomeUnknown(
        f"effect {record.id} may have happened and is escalated to an operator; it is never "
        "run again: ask again with the same key later",
        effect_id=record.id,
    )


def in_progress(record: EffectRecord, now: datetime) -> OperationInProgress:
    left = 1.0
    if record.lease_expires_at is not None:
        left = (record.lease_expires_at - now).total_seconds()
    return OperationInProgress(
        f"effect {record.id} is in progress",
        operation_id=record.id,
        retry_after=max(1.0, round(min(left, _RETRY_CAP), 1)),
    )
