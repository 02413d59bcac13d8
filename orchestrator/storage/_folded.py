"""An uneventful operation's first events, kept on its row (no I/O here).

A fresh operation that the executor claims and then answers terminally has two events:
``claimed`` and the answer (``succeeded``/``failed_final`` by the executor). Writing each as
an event row costs a heap row and three index entries per write, on the path every payment
takes. They are kept on the operation's row instead, in the write that makes them:

* ``claim_event``: ``{"actor": owner, "detail": {...}}``, written by the claim. The event's
  detail is ``claim_detail(new)``: the namespace's key and fingerprint (columns of the row,
  not stored twice) and what else it said (the wire request).
* ``answer_event``: ``{"kind", "actor", "detail"}``, written by the executor's terminal
  answer when it is the first write after the claim (version 1, so it is version 2); its
  time is the row's ``completed_at``, its states in_progress and the row's state, its id
  derived from the operation's. Detail values the row's
  columns hold (``downstream_key``, ``provider_reference``) are named under ``"="``, not
  stored twice.

Every other event (retries, unknown outcomes, the reconciler's evidence, operators, conflicts,
reaping) is an event row, as before. :func:`unfold` turns a row's kept events back into
:class:`EventRecord`\\ s and :func:`merged` puts them in a timeline with the event rows: what
``Store.events()`` (and so ``payorch ops show`` and the audit trail) tells is the same.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..core import State
from ..errors import CorruptRecord
from ..records import EventRecord, OperationRecord, Undecodable

__all__ = [
    "FOLDED_COLUMNS",
    "answer_event",
    "answer_event_id",
    "claim_event",
    "merged",
    "stripped",
    "unfold",
]

# What unfold() reads of an operation's row.
FOLDED_COLUMNS = (
    "tenant_id",
    "id",
    "idempotency_key",
    "fingerprint",
    "state",
    "downstream_key",
    "provider_reference",
    "created_at",
    "completed_at",
    "claim_event",
    "answer_event",
)
_ROW_DETAIL = frozenset({"downstream_key", "provider_reference"})
_ANSWER_IDS = uuid.UUID("5f0c7a52-2b1e-4c4f-9d0e-6a7d9b3c1e20")  # namespace of answer ids
_NAMESPACE_DETAIL = ("idempotency_key", "fingerprint")


def claim_event(owner: str, detail: Mapping[str, Any]) -> dict[str, Any]:
    """The claim's event as kept on the row: its actor, and its detail less what the row's
    columns already hold."""
    extra = {k: v for k, v in detail.items() if k not in _NAMESPACE_DETAIL}
    return {"actor": owner, "detail": extra} if extra else {"actor": owner}


def answer_event(
    record: OperationRecord,
    kind: str,
    actor: str,
    detail: Mapping[str, Any] | None,
    *,
    provider_reference: str | None,
) -> dict[str, Any]:
    """The executor's terminal answer as kept on the row of ``record`` (as claimed, version
    1), whose write sets ``provider_reference``."""
    out: dict[str, Any] = {"kind": kind, "actor": actor}
    if detail is not None:
        columns = {
            "downstream_key": record.downstream_key,
            "provider_reference": provider_reference,
        }
        same = [k for k, v in columns.items() if k in detail and detail[k] == v]
        out["detail"] = {k: v for k, v in detail.items() if k not in same}
        if same:
            out["="] = same
    return out


def answer_event_id(operation_id: str) -> str:
    """The kept answer's event id: derived from the operation's (stable, never stored)."""
    return str(uuid.uuid5(_ANSWER_IDS, operation_id))


def _kept(row: Mapping[Any, Any], column: str) -> Mapping[str, Any] | None:
    value = row[column]
    if value is None or isinstance(value, Mapping):
        return value
    problem = f"{column}: not a JSON object"
    if isinstance(value, Undecodable):
        problem = f"{column}: not valid JSON ({type(value.error).__name__}: {value.error})"[:300]
    raise CorruptRecord(
        f"operation {row['id']} of tenant {row['tenant_id']} has a corrupt stored row "
        f"({problem}): it needs an operator's repair",
        tenant_id=str(row["tenant_id"]),
        operation_id=str(row["id"]),
        problem=problem,
    )


def unfold(row: Mapping[Any, Any]) -> list[EventRecord]:
    """The events kept on an operation's row (``FOLDED_COLUMNS``), oldest first;
    ``CorruptRecord`` if one cannot be read."""
    out: list[EventRecord] = []
    claimed = _kept(row, "claim_event")
    if claimed is not None:
        detail: dict[str, Any] | None = {
            **dict(claimed.get("detail") or {}),
            "idempotency_key": row["idempotency_key"],
            "fingerprint": row["fingerprint"],
        }
        if claimed.get("stripped"):
            detail = None  # reaped: the evidence's body is gone, the event stays
        out.append(
            EventRecord(
                tenant_id=row["tenant_id"],
                id=row["id"],  # the claim's event is the operation's birth: its id
                operation_id=row["id"],
                kind="claimed",
                actor=str(claimed.get("actor", "")),
                from_state=None,
                to_state=State.IN_PROGRESS.value,
                version=1,
                detail=detail,
                created_at=row["created_at"],
            )
        )
    answer = _kept(row, "answer_event")
    if answer is not None and row["completed_at"] is not None:
        said = answer.get("detail")
        if isinstance(said, Mapping):
            said = {**said, **{k: row[k] for k in answer.get("=", ()) if k in _ROW_DETAIL}}
        out.append(
            EventRecord(
                tenant_id=row["tenant_id"],
                id=answer_event_id(row["id"]),
                operation_id=row["id"],
                kind=str(answer.get("kind", "")),
                actor=str(answer.get("actor", "")),
                from_state=State.IN_PROGRESS.value,
                to_state=row["state"],
                version=2,
                detail=said,
                created_at=row["completed_at"],
            )
        )
    return out


def merged(kept: Sequence[EventRecord], rows: Iterable[EventRecord]) -> list[EventRecord]:
    """The kept events among the event rows (already in timeline order): by time, then by
    the version each was written at (events that move nothing last), then as they came."""
    if not kept:
        return list(rows)

    def key(item: tuple[int, EventRecord]) -> tuple[Any, ...]:
        rank, e = item
        return (e.created_at, e.version is None, e.version or 0, rank)

    ranked = [(-1, e) for e in kept] + list(enumerate(rows))
    return [e for _, e in sorted(ranked, key=key)]


def stripped(value: Any) -> tuple[Any, int]:
    """A kept event with its detail removed (the reaper's), and 1 if there was one."""
    if not isinstance(value, Mapping):
        return value, 0
    out = {k: v for k, v in value.items() if k != "detail"}
    if "kind" in out:  # the answer's
        out["detail"] = None
        return out, int(value.get("detail") is not None)
    # The claim's: its detail is partly the row's columns, so it says it was stripped.
    out["stripped"] = True
    return out, int(not value.get("stripped"))
