"""What payorch stores of an operation: the plain values the store hands out and takes in.

The one redaction every stored copy of provider text goes through is
:mod:`payorch.redaction`'s :class:`Redactor` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ..core import State, attempt_ref, downstream_key, namespace_ref
from ..errors import CorruptRecord
from ._redaction import REDACTED, Redactor

if TYPE_CHECKING:
    pass

__all__ = [
    "OPERATION_COLUMNS",
    "REDACTED",
    "ClaimResult",
    "EventRecord",
    "NewOperation",
    "OperationRecord",
    "Redactor",
    "Undecodable",
    "json_ready",
]


def json_ready(record: Any) -> dict[str, Any]:
    """A record dataclass's fields for JSON: times as ISO 8601, states as their values."""
    out: dict[str, Any] = {}
    for name in record.__dataclass_fields__:
        value = getattr(record, name)
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, State):
            value = value.value
        out[name] = value
    return out


class Undecodable:
    """A stored value its column's type could not decode (SQLite only: it stores any text).

    Result processing hands this back instead of raising, so one corrupt row surfaces as a
    typed ``CorruptRecord`` when it is turned into a record, and never aborts the statement
    (or the reconciler's batch) that read it along with healthy rows.
    """

    __slots__ = ("error", "raw")

    def __init__(self, raw: object, error: Exception) -> None:
        self.raw = raw
        self.error = error

    def __repr__(self) -> str:
        return f"Undecodable({self.raw!r:.60}, {self.error})"


# What each column must read back as: (types, nullable). SQLite stores whatever it is given,
# and an operator may have edited a row by hand, so a record checks its row before use.
# A column's kind: the exact classes a healthy value has (fast path), the classes it may
# have (subclasses, slow path), and what to call it in a message.
_KINDS: dict[str, tuple[frozenset[type], tuple[type, ...], str]] = {
    "text": (frozenset({str}), (str,), "text"),
    "int": (frozenset({int}), (int,), "an integer"),
    "flag": (frozenset({bool}), (bool,), "a boolean"),
    "time": (frozenset({datetime}), (datetime,), "a timestamp"),
    "object": (frozenset({dict}), (Mapping,), "a JSON object"),
}
_OPERATION_COLUMNS = {
    "tenant_id": "text",
    "id": "text",
    "operation": "text",
    "idempotency_key": "text",
    "fingerprint": "text",
    "state": "text",
    "provider": "text",
    "downstream_key": "text",
    "provider_reference": "text?",
    "amount": "int?",
    "currency": "text?",
    "request": "object?",
    "response": "object?",
    "error_code": "text?",
    "resolution": "text?",
    "retention_seconds": "int",
    "possibly_sent": "flag",
    "attempts": "int",
    "checks": "int",
    "next_check_at": "time?",
    "needs_attention": "flag",
    "lease_owner": "text?",
    "lease_expires_at": "time?",
    "version": "int",
    "created_at": "time",
    "updated_at": "time",
    "completed_at": "time?",
    "retain_until": "time?",
    "reaped_at": "time?",
    "route": "object?",
}
_EVENT_COLUMNS = {
    "tenant_id": "text",
    "id": "text",
    "operation_id": "text",
    "kind": "text",
    "actor": "text",
    "from_state": "text?",
    "to_state": "text?",
    "version": "int?",
    "detail": "object?",
    "created_at": "time",
}
# The record's columns in order: what the hand-written PostgreSQL statements return.
OPERATION_COLUMNS: tuple[str, ...] = tuple(_OPERATION_COLUMNS)
_TIME_COLUMNS = tuple(n for n, spec in _OPERATION_COLUMNS.items() if spec.startswith("time"))

# (column, kind, nullable, exact classes accepted at once): built once, read per row.
Shape = tuple[tuple[str, str, bool, frozenset[type]], ...]


def _shape(columns: Mapping[str, str]) -> Shape:
    out = []
    for name, spec in columns.items():
        kind, nullable = spec.rstrip("?"), spec.endswith("?")
        exact = _KINDS[kind][0] | ({type(None)} if nullable else set())
        out.append((name, kind, nullable, exact))
    return tuple(out)


_OPERATION_SHAPE = _shape(_OPERATION_COLUMNS)
_EVENT_SHAPE = _shape(_EVENT_COLUMNS)


def _problem(values: Mapping[str, Any], shape: Shape) -> str | None:
    """What is wrong with a row's values, in one line, or None if each is what it should be.

    Runs on every row read (the claim's included): a healthy value costs one set lookup.
    """
    for name, kind, nullable, exact in shape:
        value = values[name]
        if value.__class__ not in exact:
            problem = _explain(name, value, kind, nullable)
            if problem is not None:
                return problem
    return None


def _explain(name: str, value: Any, kind: str, nullable: bool) -> str | None:
    _, allowed, called = _KINDS[kind]
    if value is None:
        return None if nullable else f"{name}: missing"
    if isinstance(value, Undecodable):
        # The stored text itself may hold sensitive data: name the error, not the value.
        what = "not valid JSON" if kind == "object" else f"not {called}"
        return f"{name}: {what} ({type(value.error).__name__}: {value.error})"[:300]
    if isinstance(value, allowed) and not (kind == "int" and isinstance(value, bool)):
        return None  # a subclass some driver hands out: fine
    return f"{name}: {type(value).__name__} where {called} belongs"


def _corrupt(values: Mapping[str, Any], operation_id: Any, problem: str) -> CorruptRecord:
    tenant = str(values.get("tenant_id"))
    op_id = str(operation_id)
    return CorruptRecord(
        f"operation {op_id} of tenant {tenant} has a corrupt stored row ({problem}): it "
        "needs an operator's repair; clients retry the same idempotency key later",
        tenant_id=tenant,
        operation_id=op_id,
        problem=problem,
    )


@dataclass(frozen=True, kw_only=True)
class NewOperation:
    """What a claim inserts: the namespace, its fingerprint and the effect it stands for."""

    tenant_id: str
    operation: str
    idempotency_key: str
    fingerprint: str
    provider: str
    request: Mapping[str, Any] | None = None  # already redacted
    amount: int | None = None
    currency: str | None = None
    retention: timedelta = timedelta(hours=24)
    key_scope: str = ""  # the installation's (PAYORCH_KEY_SCOPE): part of every ref
    # What the adapter will send (payorch.provider.WireRequest.stored()), kept with the claim so
    # that a re-send is that request; None when the adapter cannot say or the stored
    # request hides a sensitive value.
    wire: Mapping[str, Any] | None = None
    # A routed operation's route (payorch.routing.Route.stored()); None: not routed.
    route: Mapping[str, Any] | None = None

    @cached_property  # read by the claim and by the adapter's request: hashed once
    def downstream_key(self) -> str:
        """The provider idempotency key: from the namespace, never from a per-claim id; a
        routed operation's also from its provider (each provider's attempt has its own)."""
        ref = namespace_ref(self.tenant_id, self.operation, self.idempotency_key, self.key_scope)
        if self.route is not None:  # payorch.routing.attempt_key: its attempt's at provider
            return downstream_key(attempt_ref(ref, self.provider))
        return downstream_key(ref)


@dataclass(frozen=True, kw_only=True)
class OperationRecord:
    tenant_id: str
    id: str
    operation: str
    idempotency_key: str
    fingerprint: str
    state: State
    provider: str
    downstream_key: str
    provider_reference: str | None
    amount: int | None
    currency: str | None
    request: Mapping[str, Any] | None
    response: Mapping[str, Any] | None
    error_code: str | None
    resolution: str | None
    retention_seconds: int
    possibly_sent: bool
    attempts: int
    checks: int
    next_check_at: datetime | None
    needs_attention: bool
    lease_owner: str | None
    lease_expires_at: datetime | None
    version: int
    created_at: datetime
    updated_at: datetime
    completed_at: datetime | None
    retain_until: datetime | None
    reaped_at: datetime | None
    # A routed operation's route: its decision and every provider attempt (payorch.routing);
    # None when it was not routed.
    route: Mapping[str, Any] | None = None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> OperationRecord:
        """The record a row holds; ``CorruptRecord`` if the row cannot be what it claims."""
        return cls._checked({name: row[name] for name in _OPERATION_COLUMNS})

    @classmethod
    def from_pg(cls, row: Sequence[Any]) -> OperationRecord:
        """The record of a row read without SQLAlchemy's types: ``OPERATION_COLUMNS`` in
        order, timestamps as psycopg hands them (in the session's time zone)."""
        values = dict(zip(OPERATION_COLUMNS, row, strict=False))
        for name in _TIME_COLUMNS:
            value = values[name]
            if value is not None and value.__class__ is datetime and value.tzinfo is not UTC:
                values[name] = value.astimezone(UTC)
        return cls._checked(values)

    @classmethod
    def claimed(
        cls,
        new: NewOperation,
        *,
        op_id: str,
        owner: str,
        possibly_sent: bool,
        request: Mapping[str, Any] | None,
        created_at: datetime,
        lease_expires_at: datetime,
    ) -> OperationRecord:
        """The record a claim just inserted, from what it sent and what the database
        stamped (``created_at``, ``lease_expires_at``): what reading the row would give.
        ``request``: as it reads back (decoded JSON)."""
        values: dict[str, Any] = {
            "tenant_id": new.tenant_id,
            "id": op_id,
            "operation": new.operation,
            "idempotency_key": new.idempotency_key,
            "fingerprint": new.fingerprint,
            "state": State.IN_PROGRESS,
            "provider": new.provider,
            "downstream_key": new.downstream_key,
            "provider_reference": None,
            "amount": new.amount,
            "currency": new.currency,
            "request": request,
            "response": None,
            "error_code": None,
            "resolution": None,
            "retention_seconds": int(new.retention.total_seconds()),
            "possibly_sent": possibly_sent,
            "attempts": 1 if possibly_sent else 0,
            "checks": 0,
            "next_check_at": lease_expires_at,
            "needs_attention": False,
            "lease_owner": owner,
            "lease_expires_at": lease_expires_at,
            "version": 1,
            "created_at": created_at,
            "updated_at": created_at,
            "completed_at": None,
            "retain_until": None,
            "reaped_at": None,
            "route": dict(new.route) if new.route is not None else None,
        }
        record = object.__new__(cls)
        record.__dict__.update(values)
        return record

    def written(self, values: Mapping[str, Any]) -> OperationRecord:
        """This record after a fenced write that set ``values`` (each as it reads back)
        and moved the version by one."""
        record = object.__new__(type(self))
        record.__dict__.update(self.__dict__)
        record.__dict__.update(values)
        record.__dict__["version"] = self.version + 1
        return record

    @classmethod
    def _checked(cls, values: dict[str, Any]) -> OperationRecord:
        problem = _problem(values, _OPERATION_SHAPE)
        if problem is None:
            try:
                values["state"] = State(values["state"])
            except ValueError:
                problem = f"state: {values['state']!r:.40} is not a state"
        if problem is not None:
            raise _corrupt(values, values["id"], problem)
        # Every field checked above: fill the frozen instance directly, as its generated
        # __init__ would (which pays object.__setattr__ per field, on every row read).
        record = object.__new__(cls)
        record.__dict__.update(values)
        return record

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    @property
    def released(self) -> bool:
        """Nothing was sent and nobody holds it: the namespace's next request runs it again.

        What an operation becomes when every attempt was certainly not sent (a transient
        failure is not stored), or when its worker died before sending (abandoned).
        """
        return self.state is State.IN_PROGRESS and not self.possibly_sent and not self.lease_owner

    def to_dict(self) -> dict[str, Any]:
        return json_ready(self)


@dataclass(frozen=True, kw_only=True)
class EventRecord:
    tenant_id: str
    id: str
    operation_id: str
    kind: str
    actor: str
    from_state: str | None
    to_state: str | None
    version: int | None
    detail: Mapping[str, Any] | None
    created_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> EventRecord:
        values = {name: row[name] for name in _EVENT_COLUMNS}
        problem = _problem(values, _EVENT_SHAPE)
        if problem is not None:
            raise _corrupt(values, values["operation_id"], f"event {values['id']}: {problem}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return json_ready(self)


@dataclass(frozen=True, kw_only=True)
class ClaimResult:
    """The outcome of a claim: a new operation, or the one already in the namespace."""

    operation: OperationRecord
    created: bool
    replayed: bool = False
    detail: Mapping[str, Any] = field(default_factory=dict)
    # The namespace holds a released operation (nothing sent): the claim may run it again.
    released: bool = False
