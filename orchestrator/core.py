"""The pure core: states, transitions, validation, fingerprint, keys, backoff.

No I/O, no clock, no SQL: plain functions over plain values, shared by every driver and
explored by property tests.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from typing import Any

import http_sf
import rfc8785

from .errors import (
    ConfigurationError,
    InvalidIdempotencyKey,
    InvalidMoney,
    InvalidRequest,
    InvalidTenant,
    InvalidTransition,
    UnencodableRequest,
    UnknownOperationType,
)

__all__ = [
    "ACTIVE_STATES",
    "MAX_JSON_INT",
    "MAX_KEY_LENGTH",
    "TERMINAL_STATES",
    "State",
    "attempt_ref",
    "backoff_delay",
    "canonical_digest",
    "canonical_idempotency_key",
    "check_encodable",
    "check_transition",
    "downstream_key",
    "fingerprint",
    "is_namespace_key",
    "namespace_ref",
    "operation_id_from_downstream_key",
    "safe_text",
    "validate_idempotency_key",
    "validate_key_scope",
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


def canonical_idempotency_key(key: object) -> str:
    """The one form of a key, as ``validate_idempotency_key`` accepts it.

    Two spellings name one key (the rule of ``payorch.http``): the draft's RFC 8941
    sf-string (``"abc-19"``, with ``\\"`` and ``\\\\`` escapes) and the bare token
    (``abc-19``). A service that hands ``execute()`` the raw header gets the same namespace
    as one that strips the quotes. A value that opens a quote but is no sf-string is refused.
    """
    if isinstance(key, str) and key.startswith('"'):
        try:
            parsed = http_sf.parse(key.encode("ascii"), tltype="item")
        except (http_sf.StructuredFieldError, UnicodeEncodeError):
            raise InvalidIdempotencyKey(
                "idempotency key opens a quote but is not one RFC 8941 quoted string"
            ) from None
        if not isinstance(parsed, tuple) or not isinstance(parsed[0], str) or parsed[1]:
            raise InvalidIdempotencyKey("idempotency key must be one quoted string or a bare key")
        key = parsed[0]
        if key.startswith('"'):
            # Else the form would depend on how often it was unquoted: the rule must be
            # idempotent itself (payorch.http unquotes, then execute() looks again).
            raise InvalidIdempotencyKey("idempotency key may not itself begin with a quote")
    return validate_idempotency_key(key)


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


# The integers every JSON parser reads exactly (IEEE 754 doubles); RFC 8785 refuses others.
MAX_JSON_INT = 2**53 - 1


def _where(path: str) -> str:
    return path or "request"


def safe_text(value: object) -> str:
    """``str(value)`` that can always be encoded: lone surrogates become ``\\udXXX``.

    Error messages name the offending field, and the field name itself may be the bad input.
    """
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")


def _check_scalar(value: object, path: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise UnencodableRequest(
                f"{_where(path)} holds a string that is not valid UTF-8 (a lone surrogate)"
            ) from None
    elif isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > MAX_JSON_INT:
            raise UnencodableRequest(f"{_where(path)} is an integer beyond ±(2**53 - 1)")
    elif isinstance(value, float | Decimal):
        finite = math.isfinite(value) if isinstance(value, float) else value.is_finite()
        if not finite:
            raise UnencodableRequest(f"{_where(path)} is {value}, which JSON cannot carry")


def check_encodable(value: Any, path: str = "", *, sets: bool = True) -> bool:
    """Refuse what has no single canonical JSON form, anywhere in a request.

    A string that is not valid UTF-8 (a lone surrogate: no encoder can send it), a NaN or
    infinite number (not JSON at all), an integer outside ±(2**53 - 1) (parsers disagree
    on it) and, with ``sets=False`` (effect fields), a set: its order changes from process
    to process, and so would the fingerprint. Types this walk does not know (dates, UUIDs)
    are left to the JSON dump, which is checked again.

    Returns whether ``value`` was plain: only dicts, lists, tuples and fine scalars (no
    set, no other type), so nothing inside it needs a second look.
    """
    if _plainly_encodable(value):
        return True
    _check_walk(value, path, sets=sets)
    return False


def _plainly_encodable(value: Any) -> bool:
    """True if ``value`` is built only of dicts, lists, tuples and plain scalars that are
    fine. Every request passes through here: it is the walk below without paths, and
    anything it is not sure of (other types, a problem) goes to that walk, which explains."""
    cls = value.__class__
    if cls is str:
        return value.isascii() or _utf8(value)
    if cls is dict:
        for k, v in value.items():
            # A text key (nearly always) checked here: a call per key would cost more.
            key = (k.isascii() or _utf8(k)) if k.__class__ is str else _plainly_encodable(k)
            if not (key and _plainly_encodable(v)):
                return False
        return True
    if cls is list or cls is tuple:
        for v in value:  # noqa: SIM110 - as above
            if not _plainly_encodable(v):
                return False
        return True
    check = _PLAIN_SCALARS.get(cls)
    return check is not None and check(value)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_PLAIN_SCALARS: dict[type, Callable[[Any], bool]] = {
    int: lambda v: -MAX_JSON_INT <= v <= MAX_JSON_INT,
    bool: lambda _v: True,
    type(None): lambda _v: True,
    float: math.isfinite,
}


def _check_walk(value: Any, path: str, *, sets: bool) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _check_walk(k, f"{_where(path)} key", sets=sets)
            name = safe_text(k)
            _check_walk(v, f"{path}.{name}" if path else name, sets=sets)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_walk(v, f"{path}[{i}]", sets=sets)
    elif isinstance(value, set | frozenset):
        if not sets:
            raise UnencodableRequest(f"{_where(path)} is a set, which has no stable order")
        for v in value:
            _check_walk(v, f"{path}[]", sets=sets)
    else:
        _check_scalar(value, path)


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
    value = dict(effect)
    if _jcs_plain(value):  # no float, no odd key: nothing for the money check to refuse
        try:
            return hashlib.sha256(_PLAIN_JCS.encode(value).encode("utf-8")).hexdigest()
        except UnicodeEncodeError:
            pass  # a lone surrogate: refused below, in rfc8785's words
    _check_json_value(effect, "")
    return canonical_digest(value, "effect fields")


def canonical_digest(value: Any, what: str = "value") -> str:
    """SHA-256 (hex) of ``value``'s RFC 8785 canonical JSON (dicts, lists and JSON
    scalars); ``UnencodableRequest`` naming ``what`` if it has no canonical form."""
    try:
        canonical = canonical_json(value)
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as exc:
        # ValueError includes UnicodeEncodeError: rfc8785 sorts keys by their UTF-16 form.
        raise UnencodableRequest(f"{what} cannot be canonicalised: {safe_text(exc)}") from exc
    return hashlib.sha256(canonical).hexdigest()


def canonical_json(value: Any) -> bytes:
    """RFC 8785 (JCS) bytes of ``value``, by ``rfc8785``.

    For the values every request is made of (objects with ASCII keys, lists, texts, safe
    integers, booleans, null) the standard library's C encoder writes the very same bytes:
    keys sorted (code points and UTF-16 units order ASCII alike), the same escapes, integers
    in decimal, non-ASCII text as UTF-8. It writes those, several times faster; anything
    else (floats, other keys, other types, lone surrogates) goes to ``rfc8785``.
    ``tests/test_canonical_json.py`` holds the two equal over generated values.
    """
    if _jcs_plain(value):
        try:
            return _PLAIN_JCS.encode(value).encode("utf-8")
        except UnicodeEncodeError:
            pass  # a lone surrogate: rfc8785 refuses it with its own words
    return rfc8785.dumps(value)


_PLAIN_JCS = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":")
)


def _jcs_plain(value: Any) -> bool:
    cls = value.__class__
    if cls is int:
        return bool(-MAX_JSON_INT <= value <= MAX_JSON_INT)
    if cls is dict:
        for k, v in value.items():  # noqa: SIM110 - all() and a generator cost twice as much
            if not (k.__class__ is str and k.isascii() and _jcs_plain(v)):
                return False
        return True
    if cls is list:
        for v in value:  # noqa: SIM110 - as above
            if not _jcs_plain(v):
                return False
        return True
    return cls is str or cls is bool or value is None


_DOWNSTREAM_PREFIX = "payorch"
_REF_LENGTH = 32  # hex digits: 128 bits of SHA-256, and a key of at most 64 characters
_REF_RE = re.compile(f"[0-9a-f]{{{_REF_LENGTH}}}")
_STEP_RE = re.compile(r"[a-z_]{1,20}")


def namespace_ref(tenant_id: str, operation: str, idempotency_key: str, scope: str = "") -> str:
    """The name of a namespace that crosses to the provider: 32 hex digits of SHA-256.

    A pure function of ``(tenant, operation, key)`` (joined by NUL, which none of them may
    contain): a claim lost in a database failover and re-created by the client's retry has
    the same ref, so it sends the same downstream key and the same metadata, and the
    provider's own idempotency answers it. The operation id never crosses.

    ``scope`` (``PAYORCH_KEY_SCOPE``, :func:`validate_key_scope`) sets installations apart
    that share one provider account with overlapping tenants and keys; it must stay the
    same for the life of the installation, as the keys it made depend on it.
    """
    parts = (
        (scope, tenant_id, operation, idempotency_key)
        if scope
        else (tenant_id, operation, idempotency_key)
    )
    joined = "\x00".join(parts).encode("utf-8")
    return hashlib.sha256(b"payorch-namespace\x00" + joined).hexdigest()[:_REF_LENGTH]


def validate_key_scope(scope: object) -> str:
    """A key scope: empty (none), or 1-64 characters of letters, digits and ``_.:-``."""
    if not isinstance(scope, str) or (scope and not _TENANT_RE.fullmatch(scope)) or len(scope) > 64:
        raise ConfigurationError(
            "key scope (PAYORCH_KEY_SCOPE) must be empty or 1-64 characters of letters, "
            "digits and '_.:-'"
        )
    return scope


def downstream_key(ref: str, step: str = "submit") -> str:
    """The provider idempotency key: ``payorch:<namespace ref>:<step>`` (at most 61 chars).

    Never random, never per claim: a re-submission, after a crash or after a failover that
    lost the claim, reuses exactly the same key.
    """
    if not _STEP_RE.fullmatch(step):
        raise ValueError(f"step {step!r} must be 1-20 lower-case letters")
    return f"{_DOWNSTREAM_PREFIX}:{ref}:{step}"


def attempt_ref(ref: str, provider: str) -> str:
    """A routed operation's ref at one provider: 32 hex digits of SHA-256 of the namespace's
    ref and the provider's name, so each provider's attempt has its own downstream key
    (two accounts at one acquirer share a key space), as stable as the ref itself."""
    joined = f"{ref}\x00{provider}".encode()
    return hashlib.sha256(b"payorch-attempt\x00" + joined).hexdigest()[:_REF_LENGTH]


def is_namespace_key(key: str) -> bool:
    """Whether ``key`` is a downstream key of today's form (a namespace ref inside)."""
    parts = key.split(":")
    return len(parts) == 3 and parts[0] == _DOWNSTREAM_PREFIX and bool(_REF_RE.fullmatch(parts[1]))


def operation_id_from_downstream_key(key: str) -> str | None:
    """The operation id inside a downstream key of the earlier form (``payorch:<id>:<step>``,
    sent before keys derived from the namespace); None for any other key."""
    parts = key.split(":")
    if len(parts) == 3 and parts[0] == _DOWNSTREAM_PREFIX and not _REF_RE.fullmatch(parts[1]):
        return parts[1] or None
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
