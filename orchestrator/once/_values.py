"""The values of payorch.once: what a stored effect is, what a call gets back, what the
function learns about its run, an inbound message, and the policy of one decorated
function or consumer. Plain data, no I/O."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from ..core import State, downstream_key, namespace_ref, validate_key_scope
from ..errors import ConfigurationError, CorruptRecord
from ..records import Undecodable, json_ready

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_RETENTION",
    "Effect",
    "EffectRecord",
    "EffectResult",
    "InboundMessage",
    "Policy",
    "Target",
    "effect_downstream_key",
    "make_policy",
]

DEFAULT_LEASE = timedelta(seconds=60)
DEFAULT_RETENTION = timedelta(hours=24)
MAX_NAMESPACE = 128  # payorch_effects.namespace
_MAX_OWNER = 200  # payorch_effects.lease_owner
# A namespace is named in code (a consumer's name, a function's namespace): a bounded
# metric label, never user input, so it is refused at decoration time when malformed.
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]*")
# namespace_ref's "operation": kept apart from every payment operation type ("noun.verb"),
# so an effect namespace named like an operation never shares its downstream keys.
_REF_PREFIX = "once:"
_STEP = "effect"


@dataclass(frozen=True, slots=True, kw_only=True)
class EffectRecord:
    """One row of ``payorch_effects``: an effect claimed in (tenant, namespace, key).

    ``possibly_sent``: some attempt under this key may have reached the outside world.
    ``error`` holds what the last failed attempt raised (``kind``, ``type``, ``message``)
    and, once an operator decided, ``resolution`` (actor, reason).
    """

    tenant_id: str
    namespace: str
    key: str
    id: str
    fingerprint: str
    state: State
    possibly_sent: bool
    attempts: int
    result: Any
    error: Mapping[str, Any] | None
    needs_attention: bool
    lease_owner: str | None
    lease_expires_at: datetime | None
    version: int
    created_at: datetime
    updated_at: datetime
    completed_at: datetime | None
    retain_until: datetime | None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> EffectRecord:
        """The record of a row; a value SQLite could not decode is a ``CorruptRecord``."""
        tenant, effect_id = str(row["tenant_id"]), str(row["id"])
        for name in ("result", "error", "lease_expires_at", "created_at", "updated_at"):
            if isinstance(row[name], Undecodable):
                raise _corrupt(tenant, effect_id, f"{name} cannot be decoded")
        error = row["error"]
        if error is not None and not isinstance(error, Mapping):
            raise _corrupt(tenant, effect_id, "error is not a JSON object")
        try:
            state = State(row["state"])
        except ValueError:
            raise _corrupt(tenant, effect_id, f"unknown state {row['state']!r}") from None
        return cls(
            tenant_id=tenant,
            namespace=row["namespace"],
            key=row["key"],
            id=effect_id,
            fingerprint=row["fingerprint"],
            state=state,
            possibly_sent=bool(row["possibly_sent"]),
            attempts=int(row["attempts"]),
            result=row["result"],
            error=error,
            needs_attention=bool(row["needs_attention"]),
            lease_owner=row["lease_owner"],
            lease_expires_at=row["lease_expires_at"],
            version=int(row["version"]),
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            completed_at=row["completed_at"],
            retain_until=row["retain_until"],
        )

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (times as ISO 8601), for the CLI and for APIs."""
        return json_ready(self)

    @property
    def released(self) -> bool:
        """In progress with nobody holding it: the next call for the key runs it."""
        return self.state is State.IN_PROGRESS and self.lease_expires_at is None


def _corrupt(tenant: str, effect_id: str, problem: str) -> CorruptRecord:
    return CorruptRecord(
        f"effect {effect_id} of tenant {tenant} has a corrupt stored row ({problem}): it "
        "needs an operator's repair; retry the same key later",
        tenant_id=tenant,
        operation_id=effect_id,
        problem=problem,
    )


def effect_downstream_key(tenant_id: str, namespace: str, key: str, scope: str = "") -> str:
    """``payorch:<ref>:effect``: a pure function of (scope, tenant, namespace, key), so every
    run of the effect (a re-run, a claim lost in a failover) sends the same key."""
    return downstream_key(namespace_ref(tenant_id, _REF_PREFIX + namespace, key, scope), _STEP)


@dataclass(frozen=True, slots=True, kw_only=True)
class Effect:
    """What a running function knows of its run (:func:`payorch.once.current`).

    ``downstream_key`` is the idempotency key to hand the system the effect happens in (an
    email API, another ledger): the same on every run under this key. ``attempt`` counts
    runs (1 the first time). ``rerun``: an earlier run may have reached that system, and
    this one relies on it deduplicating on ``downstream_key`` (``rerun_safe``).
    """

    id: str
    tenant_id: str
    namespace: str
    key: str
    downstream_key: str
    attempt: int
    rerun: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class EffectResult:
    """A call's answer: the stored result (``value``, as JSON gives it back) and whether it
    was ``replayed`` (the effect ran before; nothing ran now)."""

    value: Any
    replayed: bool
    effect_id: str
    tenant_id: str
    namespace: str
    key: str
    attempts: int


@dataclass(frozen=True, slots=True)
class InboundMessage:
    """One delivery of an inbound message: a webhook, a broker delivery, a job.

    ``id`` is the sender's message id (the key: a redelivery carries the same one);
    ``payload`` what decides the effect (fingerprinted: JSON, or bytes); ``metadata``
    transport details (headers, offsets, delivery counts), never fingerprinted.
    """

    id: str
    payload: Any = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """Which effect one call is: its namespace key and fingerprint."""

    tenant_id: str
    key: str
    fingerprint: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """How one decorated function (or consumer, or claim) runs its effects."""

    namespace: str
    lease: timedelta
    retention: timedelta
    retry_on: tuple[type[BaseException], ...]
    final_on: tuple[type[BaseException], ...]
    rerun_safe: bool
    wait: timedelta | None
    owner: str
    key_scope: str

    def effect(self, record: EffectRecord, *, rerun: bool) -> Effect:
        return Effect(
            id=record.id,
            tenant_id=record.tenant_id,
            namespace=record.namespace,
            key=record.key,
            downstream_key=effect_downstream_key(
                record.tenant_id, record.namespace, record.key, self.key_scope
            ),
            attempt=record.attempts,
            rerun=rerun,
        )


def _exception_types(name: str, value: object) -> tuple[type[BaseException], ...]:
    if isinstance(value, type):
        types: tuple[Any, ...] = (value,)
    elif isinstance(value, tuple | list):
        types = tuple(value)
    else:
        raise ConfigurationError(f"{name} takes an exception class or a tuple of them")
    for t in types:
        if not (isinstance(t, type) and issubclass(t, Exception)):
            raise ConfigurationError(f"{name} takes exception classes, not {t!r}")
    return types


def make_policy(
    *,
    namespace: object,
    lease: timedelta,
    retention: timedelta,
    retry_on: object,
    final_on: object,
    rerun_safe: bool,
    wait: timedelta | None,
    owner: str | None,
    key_scope: str | None,
) -> Policy:
    """A checked :class:`Policy`: everything here is code, refused when it is built."""
    if (
        not isinstance(namespace, str)
        or len(namespace) > MAX_NAMESPACE
        or not _NAMESPACE_RE.fullmatch(namespace)
    ):
        raise ConfigurationError(
            f"namespace {namespace!r}: 1-{MAX_NAMESPACE} characters of letters, digits "
            "and '_.:/-', starting with a letter or digit"
        )
    if lease <= timedelta(0):
        raise ConfigurationError("lease must be positive: it bounds how long one run holds the key")
    if retention <= timedelta(0):
        raise ConfigurationError("retention must be positive")
    if wait is not None and wait < timedelta(0):
        raise ConfigurationError("wait must not be negative")
    retry, final = _exception_types("retry_on", retry_on), _exception_types("final_on", final_on)
    both = set(retry) & set(final)
    if both:
        names = ", ".join(sorted(t.__name__ for t in both))
        raise ConfigurationError(f"{names} cannot be both retry_on and final_on")
    who = owner if owner is not None else f"{socket.gethostname()}:{os.getpid()}"
    if not who or len(who) > _MAX_OWNER:
        raise ConfigurationError(f"owner must be 1-{_MAX_OWNER} characters")
    return Policy(
        namespace=namespace,
        lease=lease,
        retention=retention,
        retry_on=retry,
        final_on=final,
        rerun_safe=rerun_safe,
        wait=wait,
        owner=who,
        # None: the environment's, as the executor reads it, so every process agrees.
        key_scope=validate_key_scope(
            os.environ.get("PAYORCH_KEY_SCOPE", "") if key_scope is None else key_scope
        ),
    )
