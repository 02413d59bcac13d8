"""Plain values the store hands out and takes in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from .core import State

__all__ = ["ClaimResult", "EventRecord", "NewOperation", "OperationRecord"]


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

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> OperationRecord:
        values = {name: row[name] for name in cls.__dataclass_fields__}
        values["state"] = State(values["state"])
        return cls(**values)

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, State):
                value = value.value
            out[name] = value
        return out


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
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["created_at"] = self.created_at.isoformat()
        return out


@dataclass(frozen=True, kw_only=True)
class ClaimResult:
    """The outcome of a claim: a new operation, or the one already in the namespace."""

    operation: OperationRecord
    created: bool
    replayed: bool = False
    detail: Mapping[str, Any] = field(default_factory=dict)
