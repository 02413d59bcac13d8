"""What a look for unexplained provider effects found (:mod:`payorch.reconciling._unexplained`):
plain values, for the CLI, the daemon and callers."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from ..provider import ProviderEffect

__all__ = ["Finding", "ScanReport", "Skipped", "Verdict"]


class Verdict(enum.StrEnum):
    EXPLAINED = "explained"  # an operation of its tenant knows it
    UNEXPLAINED = "unexplained"  # none does
    ADOPTED = "adopted"  # none did: this scan adopted it


@dataclass(frozen=True, kw_only=True)
class Finding:
    """What one listed effect of payorch's is, in the store's eyes."""

    provider: str
    effect: ProviderEffect
    verdict: Verdict
    # The operation that explains it, was adopted for it, or holds its namespace released.
    operation_id: str | None = None
    explained_by: str | None = None  # namespace, downstream_key, reference, operation_id
    refusal: str | None = None  # why an unexplained one cannot be adopted
    # Its namespace's operation is released (NOTHING_SENT), so it does not explain the
    # effect; for an adopted one: that operation was moved to the effect's outcome.
    nothing_sent: bool = False
    note: str | None = None  # why an adoption ended without adopting it

    @property
    def adoptable(self) -> bool:
        return self.verdict is Verdict.UNEXPLAINED and self.refusal is None

    def to_dict(self) -> dict[str, object]:
        return {
            "provider": self.provider,
            "verdict": self.verdict.value,
            "operation_id": self.operation_id,
            "explained_by": self.explained_by,
            "adoptable": self.adoptable,
            "refusal": self.refusal,
            "nothing_sent": self.nothing_sent,
            "note": self.note,
            "effect": self.effect.evidence(),
        }


@dataclass(frozen=True, kw_only=True)
class Skipped:
    """An effect under payorch's tags that is not this installation's (another key scope)."""

    provider: str
    effect: ProviderEffect
    reason: str

    def to_dict(self) -> dict[str, object]:
        return {
            "provider": self.provider,
            "reference": self.effect.provider_reference,
            "reason": self.reason,
            "tags": dict(self.effect.tags),
        }


@dataclass(kw_only=True)
class ScanReport:
    """One listing checked: every effect of payorch's, and how many were someone else's."""

    provider: str
    since: datetime
    until: datetime
    listed: int = 0
    # Effects without payorch's tags, and those under another installation's key scope
    # (also in ``skipped``, with the reason): not judged.
    not_ours: int = 0
    # Effects of tenants outside the look's ``tenant_ids`` (another shard's): not judged.
    other_tenants: int = 0
    findings: list[Finding] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        found = Counter(f.verdict.value for f in self.findings)
        refused = sum(1 for f in self.findings if f.refusal is not None)
        return {
            "listed": self.listed,
            "not_ours": self.not_ours,
            "other_scope": len(self.skipped),
            "other_tenants": self.other_tenants,
            **{v.value: found.get(v.value, 0) for v in Verdict},
            "not_adoptable": refused,
        }
