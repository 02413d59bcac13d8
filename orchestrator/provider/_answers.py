"""A provider's answer, classified: the vocabulary every adapter, the executor and the
reconciler share (re-exported by :mod:`payorch.provider`)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Answer", "AnswerKind"]


class AnswerKind(enum.StrEnum):
    SUCCEEDED = "succeeded"
    DECLINED = "declined"  # final: the provider refused, no money moved
    PENDING = "pending"  # accepted, not settled yet; ask again later
    AMBIGUOUS = "ambiguous"  # possibly sent, no usable answer
    NOT_SENT = "not_sent"  # certainly not sent (connect error, pool time-out, 429)
    NOT_FOUND = "not_found"  # status query only: the provider knows nothing (yet)


@dataclass(frozen=True, kw_only=True)
class Answer:
    """One classified provider answer, with the evidence that justifies it."""

    kind: AnswerKind
    provider_reference: str | None = None
    status_code: int | None = None
    retry_after: float | None = None  # seconds; for NOT_SENT and PENDING
    code: str | None = None  # provider's error / decline code, or the exception name
    message: str | None = None
    body: Mapping[str, Any] | None = None  # parsed JSON body, if any
    raw: str | None = None  # raw body, truncated to RAW_EVIDENCE_LIMIT
    # Other provider objects the lookup found for the same operation: a duplicate effect.
    duplicates: tuple[str, ...] = ()

    @property
    def possibly_sent(self) -> bool:
        return self.kind is not AnswerKind.NOT_SENT

    def evidence(self) -> dict[str, Any]:
        """A JSON-able record of this answer for the event log."""
        out: dict[str, Any] = {"kind": self.kind.value, "possibly_sent": self.possibly_sent}
        for name in ("provider_reference", "status_code", "retry_after", "code", "message"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.duplicates:
            out["duplicates"] = list(self.duplicates)
        if self.body is not None:
            out["body"] = dict(self.body)
        elif self.raw is not None:
            out["raw"] = self.raw
        return out
