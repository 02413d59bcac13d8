"""The tags payorch puts on what it sends, and what a provider holds as its listing shows
it: :class:`ProviderEffect` and the optional :class:`EffectLister` an adapter implements
(all re-exported by :mod:`payorch.provider`)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..clients import RAW_EVIDENCE_LIMIT
from ..errors import InvalidRequest, ProviderListingFailed

if TYPE_CHECKING:
    from ._answers import Answer, AnswerKind

__all__ = [
    "TAG_FINGERPRINT",
    "TAG_KEY",
    "TAG_LEGACY_OPERATION_ID",
    "TAG_OPERATION",
    "TAG_REF",
    "TAG_TENANT",
    "EffectLister",
    "ProviderEffect",
    "bounded_object",
    "listing_failed",
    "listing_range",
    "payorch_tags_of",
]

# The metadata keys payorch adds to what it sends: each a pure function of the namespace.
TAG_REF = "payorch_ref"
TAG_TENANT = "payorch_tenant_id"
TAG_OPERATION = "payorch_operation"
TAG_KEY = "payorch_idempotency_key"
# The request's fingerprint: with the three above, enough to adopt an effect whose claim
# was lost as the operation its client's retry will find (``payorch effects``).
TAG_FINGERPRINT = "payorch_fingerprint"
# Sent before downstream keys came from the namespace; still sent for those operations, so
# a re-submission repeats their first request exactly.
TAG_LEGACY_OPERATION_ID = "payorch_operation_id"


# Never kept with an effect's evidence: a PaymentIntent's client secret lets its holder
# confirm the payment from a browser.
_SECRET_FIELDS = frozenset({"client_secret"})


@dataclass(frozen=True, kw_only=True)
class ProviderEffect:
    """One effect a provider holds, as its listing shows it (:class:`EffectLister`)."""

    provider_reference: str
    # SUCCEEDED, DECLINED or PENDING; AMBIGUOUS for a status the adapter cannot read.
    kind: AnswerKind
    amount: int | None
    currency: str | None
    created_at: datetime
    # The payorch_* metadata found on it (payorch_tags_of): empty when payorch did not
    # make it.
    tags: Mapping[str, str]
    object_type: str  # the provider's kind of object, e.g. "payment_intent"
    # The idempotency key the provider saw, when its objects tell it (the sandbox's do).
    downstream_key: str | None = None
    code: str | None = None  # a decline's code, as a status query would store it
    raw: Mapping[str, Any] = field(default_factory=dict)  # the object (bounded_object)

    @property
    def ours(self) -> bool:
        """Whether payorch's tags mark it: a tenant, and a namespace ref or operation id."""
        return TAG_TENANT in self.tags and (
            TAG_REF in self.tags or TAG_LEGACY_OPERATION_ID in self.tags
        )

    def evidence(self) -> dict[str, Any]:
        """A JSON-able record of the effect for the event log."""
        out: dict[str, Any] = {
            "provider_reference": self.provider_reference,
            "kind": self.kind.value,
            "object_type": self.object_type,
            "amount": self.amount,
            "currency": self.currency,
            "created_at": self.created_at.isoformat(),
            "tags": dict(self.tags),
        }
        if self.downstream_key is not None:
            out["downstream_key"] = self.downstream_key
        if self.code is not None:
            out["code"] = self.code
        out["object"] = dict(self.raw)
        return out


@runtime_checkable
class EffectLister(Protocol):
    """Optional, beside :class:`Provider`: an adapter that can list the effects it holds.

    ``list_effects`` yields the effects created between ``since`` and ``until`` (aware
    datetimes, both included, as the provider's clock dates them), reading one bounded page
    per request as the caller iterates. Transport errors, 429, 5xx and unreadable pages
    raise :class:`~payorch.errors.ProviderListingFailed`; nothing from httpx escapes.
    """

    @property
    def name(self) -> str: ...

    def list_effects(self, since: datetime, until: datetime) -> Iterator[ProviderEffect]: ...


def listing_range(since: datetime, until: datetime) -> tuple[int, int]:
    """``[since, until]`` as whole Unix seconds that cover it (providers date objects so)."""
    if since.tzinfo is None or until.tzinfo is None:
        raise InvalidRequest("a listing's bounds must be aware datetimes (e.g. UTC)")
    if since > until:
        raise InvalidRequest(f"a listing from {since.isoformat()} cannot end before it")
    return math.floor(since.timestamp()), math.ceil(until.timestamp())


def listing_failed(provider: str, answer: Answer) -> ProviderListingFailed:
    """The typed error for a listing page that came back as ``answer`` (no effects)."""
    code = answer.code or answer.kind.value
    detail = f": {answer.message}" if answer.message and answer.message != code else ""
    return ProviderListingFailed(
        f"{provider}: listing effects failed ({code}{detail}); nothing was decided, try again",
        code=code,
    )


def payorch_tags_of(metadata: object) -> dict[str, str]:
    """The ``payorch_*`` entries of an object's metadata (string values only)."""
    if not isinstance(metadata, Mapping):
        return {}
    return {
        k: v
        for k, v in metadata.items()
        if isinstance(k, str) and k.startswith("payorch_") and isinstance(v, str)
    }


def bounded_object(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A provider object to keep as evidence: without secrets, at most RAW_EVIDENCE_LIMIT
    bytes of JSON; a larger one keeps its scalar fields and its metadata."""
    kept = {k: v for k, v in obj.items() if k not in _SECRET_FIELDS}
    if len(json.dumps(kept, default=str)) <= RAW_EVIDENCE_LIMIT:
        return kept
    small: dict[str, Any] = {
        k: v
        for k, v in kept.items()
        if v is None or isinstance(v, bool | int | float) or (isinstance(v, str) and len(v) < 256)
    }
    small["metadata"] = payorch_tags_of(kept.get("metadata"))
    small["truncated"] = True
    return small
