"""A cross-provider duplicate's flag (payorch.routing): the event that records both
effects of one namespace at two providers, and what reads it back (whether an effect is
known, what a provider that cannot be asked told, whether a flag is still open).

Three hands raise it: the reconciler's cross-provider check (a status query of a provider
the operation moved away from), a webhook of that provider, and a settlement row of it
(``settlement_duplicate`` with ``cross_provider``). No I/O but the store's event reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..provider import AnswerKind
from ..records import EventRecord, OperationRecord
from ..routing import attempts_of
from ..storage._store import Store

__all__ = [
    "ACKNOWLEDGED",
    "CROSS_DUPLICATE",
    "CROSS_LEFT",
    "CROSS_REVERSAL",
    "cross_flag_open",
    "duplicate_detail",
    "is_cross_flag",
    "names_late",
    "recorded_late",
    "same_late",
]

CROSS_DUPLICATE = "cross_provider_duplicate"  # the flag: both effects, in one event
CROSS_REVERSAL = "cross_provider_reversal"  # the later effect voided or refunded
CROSS_LEFT = "cross_provider_left"  # the policy could not reverse it: the operator decides
ACKNOWLEDGED = "acknowledged"  # payorch.operator's acknowledgement of a flag
_SETTLED_ROW = "settlement_duplicate"  # payorch.recon's flag of a row


def same_late(
    detail: Mapping[str, Any] | None, provider: str, key: str, reference: str | None
) -> bool:
    """Whether a ``cross_provider_duplicate`` event recorded this later effect: the same
    provider, and its reference (or, with none yet, its key)."""
    for effect in (detail or {}).get("effects") or ():
        if isinstance(effect, Mapping) and not effect.get("answered"):
            if effect.get("provider") != provider:
                return False
            if reference is not None:
                return bool(effect.get("provider_reference") == reference)
            return bool(effect.get("downstream_key") == key)
    return False


def names_late(event: EventRecord, provider: str, key: str, reference: str | None) -> bool:
    """Whether ``event`` flagged this later effect already, whoever raised it: the look's or
    a webhook's ``cross_provider_duplicate``, or a settlement row's naming that attempt."""
    if event.kind == CROSS_DUPLICATE:
        return same_late(event.detail, provider, key, reference)
    crossed = _row_crossing(event)
    if crossed is None or crossed.get("provider") != provider:
        return False
    if crossed.get("attempt_key") == key:
        return True
    refs = {crossed.get("reference"), crossed.get("payment_reference")} - {None}
    return reference is not None and reference in refs


def duplicate_detail(
    record: OperationRecord, late: Mapping[str, Any], *, policy: str | None
) -> dict[str, Any]:
    """A ``cross_provider_duplicate`` event's detail: the operation's own effect (the one
    its client was answered with) and the ``late`` one (provider, downstream_key,
    provider_reference, state, evidence) found at a provider it moved away from."""
    return {
        "severity": "critical",
        "policy": policy,
        "effects": [
            {
                "provider": record.provider,
                "downstream_key": record.downstream_key,
                "provider_reference": record.provider_reference,
                "state": record.state.value,
                "answered": True,
            },
            {**late, "answered": False},
        ],
    }


def recorded_late(events: Sequence[EventRecord], provider: str, key: str) -> str | None:
    """The reference of money at ``provider`` under ``key`` that the operation's events
    record without a status query (a webhook's ``cross_provider_duplicate``, a settlement
    row's ``settlement_duplicate`` naming that attempt); None when none does."""
    for event in events:  # the first recorded: the effect the attempt made
        detail = event.detail or {}
        if event.kind == CROSS_DUPLICATE:
            for late in detail.get("effects") or ():
                if (
                    isinstance(late, Mapping)
                    and not late.get("answered")
                    and (late.get("provider"), late.get("downstream_key")) == (provider, key)
                    and late.get("state") == AnswerKind.SUCCEEDED.value
                    and late.get("provider_reference")
                ):
                    return str(late["provider_reference"])
        elif (crossed := _row_crossing(event)) is not None and (
            crossed.get("provider"),
            crossed.get("attempt_key"),
        ) == (provider, key):
            found = crossed.get("payment_reference") or crossed.get("reference")
            if found:
                return str(found)
    return None


def is_cross_flag(event: EventRecord) -> bool:
    """Whether ``event`` flags a cross-provider duplicate (the reconciler's, a webhook's, or
    a settlement row's naming another provider's attempt)."""
    return event.kind == CROSS_DUPLICATE or _row_crossing(event) is not None


def _row_crossing(event: EventRecord) -> Mapping[str, Any] | None:
    """A settlement row's flag's ``cross_provider`` (payorch.recon): the attempt it names."""
    if event.kind != _SETTLED_ROW:
        return None
    crossed = (event.detail or {}).get("cross_provider")
    return crossed if isinstance(crossed, Mapping) else None


def cross_flag_open(store: Store, record: OperationRecord) -> bool:
    """Whether a routed ``record`` holds a cross-provider duplicate flag no operator has
    acknowledged since: a write that settles it keeps its ``needs_attention``."""
    route = record.route
    if not route or (len(attempts_of(route)) < 2 and not route.get("skipped")):
        return False  # it never left a provider: no second effect to flag
    open_ = False
    for event in store.events(record.tenant_id, record.id):
        if is_cross_flag(event):
            open_ = True
        elif event.kind == ACKNOWLEDGED:
            open_ = False
    return open_
