"""The pure core: states, transitions, validation, fingerprint, keys, backoff.

No I/O, no clock, no SQL: plain functions over plain values, shared by every driver and
explored by property tests.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import rfc8785

from .errors import (
    InvalidIdempotencyKey,
    InvalidMoney,
    InvalidRequest,
    InvalidTenant,
    InvalidTransition,
    UnknownOperationType,
)

__all__ = [
    "ACTIVE_STATES",
    "MAX_KEY_LENGTH",
    "TERMINAL_STATES",
    "State",
    "backoff_delay",
    "check_transition",
    "downstream_key",
    "fingerprint",
    "operation_id_from_downstream_key",
    "validate_idempotency_key",
    "validate_operation_name",
    "validate_tenant",
]

MAX_KEY_LENGTH = 255
MAX_TENANT_LENGTH = 64


class State(enum.StrEnum):
    IN_PROGRESS = "in_progress"
    OUTCOME_UNKNOWN = "outcome_unknown"
    SUCCEEDED = "succeeded"
    FAILED_FINAL = "failed_final"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({State.SUCCEEDED, State.FAILED_FINAL})
ACTIVE_STATES = frozenset({State.IN_PROGRESS, State.OUTCOME_UNKNOWN})

# from-state -> states it may move to. A same-state "transition" is a bookkeeping write
# (lease renewal, a recorded attempt, a scheduled re-check), still fenced by version.
_ALLOWED: dict[State, frozenset[State]] = {
    State.IN_PROGRESS: frozenset(
        {State.IN_PROGRESS, State.OUTCOME_UNKNOWN, State.SUCCEEDED, State.FAILED_FINAL}
    ),
    State.OUTCOME_UNKNOWN: frozenset(
        {State.OUTCOME_UNKNOWN, State.IN_PROGRESS, State.SUCCEEDED, State.FAILED_FINAL}
    ),
    State.SUCCEEDED: frozenset(),
    State.FAILED_FINAL: frozenset(),
}


def check_transition(current: State, target: State) -> None:
    """Raise InvalidTransition unless the state machine allows ``current -> target``."""
    if target not in _ALLOWED[current]:
        raise InvalidTransition(f"{current.value} cannot move to {target.value}")


# Printable ASCII without spaces: what HTTP headers carry safely and what providers accept.
_KEY_RE = re.compile(r"[\x21-\x7e]+")
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")
_OPERATION_RE = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+")


def validate_idempotency_key(key: object) -> str:
    if not isinstance(key, str) or key == "":
        raise InvalidIdempotencyKey("idempotency key is missing or empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidIdempotencyKey(f"idempotency key is longer than {MAX_KEY_LENGTH} characters")
    if not _KEY_RE.fullmatch(key):
        raise InvalidIdempotencyKey("idempotency key must be printable ASCII without spaces")
    return key


def validate_tenant(tenant_id: object) -> str:
    if not isinstance(tenant_id, str) or tenant_id == "":
        raise InvalidTenant("tenant id is missing or empty")
    if len(tenant_id) > MAX_TENANT_LENGTH or not _TENANT_RE.fullmatch(tenant_id):
        raise InvalidTenant(
            f"tenant id must be 1-{MAX_TENANT_LENGTH} characters of letters, digits, '_.:-'"
        )
    return tenant_id


def validate_operation_name(name: object, known: Iterable[str] | None = None) -> str:
    if not isinstance(name, str) or not _OPERATION_RE.fullmatch(name) or len(name) > 64:
        raise UnknownOperationType(f"operation name {name!r} is not of the form 'noun.verb'")
    if known is not None and name not in set(known):
        raise UnknownOperationType(f"operation {name!r} is not registered")
    return name


def _check_json_value(value: Any, path: str) -> None:
    # Money must never be a float: binary floats cannot hold minor units exactly, and two
    # spellings of one amount would give two fingerprints.
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, int):
        return
    if isinstance(value, float):
        raise InvalidMoney(f"{path or 'value'} is a float; use integer minor units")
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidRequest(f"{path or 'value'} has a non-string key {k!r}")
            _check_json_value(v, f"{path}.{k}" if path else k)
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_json_value(v, f"{path}[{i}]")
        return
    raise InvalidRequest(f"{path or 'value'} of type {type(value).__name__} is not JSON")


def fingerprint(effect: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the RFC 8785 canonical JSON of the effect fields."""
    _check_json_value(effect, "")
    try:
        canonical = rfc8785.dumps(dict(effect))
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"effect fields cannot be canonicalised: {exc}") from exc
    return hashlib.sha256(canonical).hexdigest()


_DOWNSTREAM_PREFIX = "payorch"


def downstream_key(operation_id: str, step: str = "submit") -> str:
    """The provider idempotency key: a pure function of operation id and step.

    Never random: a re-submission after a crash must reuse exactly the same key.
    """
    if not re.fullmatch(r"[a-z_]+", step):
        raise ValueError(f"step {step!r} must be lower-case letters")
    return f"{_DOWNSTREAM_PREFIX}:{operation_id}:{step}"


def operation_id_from_downstream_key(key: str) -> str | None:
    parts = key.split(":")
    if len(parts) == 3 and parts[0] == _DOWNSTREAM_PREFIX:
        return parts[1]
    return None


def backoff_delay(
    attempt: int,
    *,
    base: float,
    cap: float,
    rand: Callable[[], float],
    floor: float = 0.0,
) -> float:
    """Full-jitter exponential backoff: uniform in [floor, min(cap, base * 2**attempt)].

    ``floor`` honours a provider's Retry-After; ``rand`` returns [0, 1).
    """
    ceiling = min(cap, base * float(2 ** max(0, attempt)))
    ceiling = max(ceiling, floor)
    return floor + (ceiling - floor) * rand()


def max_backoff_total(attempts: int, *, base: float, cap: float) -> float:
    """The longest a run of ``attempts`` retries can sleep (for lease sizing)."""
    return sum(min(cap, base * float(2**i)) for i in range(attempts))
