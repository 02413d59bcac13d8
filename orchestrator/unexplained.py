"""Effects no operation explains: a provider's effects made under payorch's tags, checked
against the store, and adopted as operations flagged for attention.

A claim committed on a primary can vanish in a failover (asynchronous replication); if its
client never comes back, the charge it made is invisible: no operation, nothing for the
reconciler to settle. Listing the provider's effects (:class:`~payorch.provider.EffectLister`)
finds it, and the tags every effect carries (:func:`~payorch.provider.provider_tags`) name
the namespace it was made for.

An effect is *explained* when an operation of its tenant has its namespace, its downstream
key or its provider reference (an effect tagged before keys came from the namespace: its
operation id). *Adopting* an unexplained one creates the operation its lost claim would
have become: the same namespace and fingerprint, the downstream key re-derived from the
namespace (the key the provider saw), in the state the effect proves (succeeded,
failed_final for a decline, outcome_unknown while pending), flagged for attention, with an
``adopted`` event holding the provider's object. The client's retry with the same key and
fields then replays that outcome instead of charging again; other fields get
``IdempotencyKeyReused``. An effect without a fingerprint tag cannot be adopted: a retry
could not be told from another request under the key.
"""

from __future__ import annotations

import enum
import logging
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from . import logs
from .adoption import ADOPTED_EVENT, ADOPTED_RESOLUTION, insert_adopted
from .core import (
    downstream_key,
    namespace_ref,
    validate_idempotency_key,
    validate_operation_name,
    validate_tenant,
)
from .errors import (
    CorruptRecord,
    InvalidRequest,
    ListingUnsupported,
    OperationNotFound,
    PayorchError,
)
from .operations import MONEY_RETENTION, Registry
from .outcome import decide
from .provider import (
    TAG_FINGERPRINT,
    TAG_KEY,
    TAG_LEGACY_OPERATION_ID,
    TAG_OPERATION,
    TAG_REF,
    TAG_TENANT,
    Answer,
    AnswerKind,
    EffectLister,
    ProviderEffect,
)
from .records import NewOperation, OperationRecord
from .store import Store

__all__ = [
    "ADOPTED_EVENT",
    "Finding",
    "ScanReport",
    "UnexplainedWatch",
    "Verdict",
    "adopt",
    "adoption_refusal",
    "explain",
    "lister_of",
    "scan",
]

MAX_ACTOR = 200  # payorch_events.actor
MAX_REASON = 2000
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")
_ADOPTABLE = frozenset({AnswerKind.SUCCEEDED, AnswerKind.DECLINED, AnswerKind.PENDING})

log = logging.getLogger("payorch.unexplained")


class Verdict(enum.StrEnum):
    EXPLAINED = "explained"  # an operation of its tenant knows it
    UNEXPLAINED = "unexplained"  # none does
    ADOPTED = "adopted"  # none did: this scan created one


@dataclass(frozen=True, kw_only=True)
class Finding:
    """What one listed effect of payorch's is, in the store's eyes."""

    provider: str
    effect: ProviderEffect
    verdict: Verdict
    operation_id: str | None = None  # the operation that explains it, or was adopted for it
    explained_by: str | None = None  # namespace, downstream_key, reference, operation_id
    refusal: str | None = None  # why an unexplained one cannot be adopted

    def to_dict(self) -> dict[str, object]:
        return {
            "provider": self.provider,
            "verdict": self.verdict.value,
            "operation_id": self.operation_id,
            "explained_by": self.explained_by,
            "adoptable": self.verdict is Verdict.UNEXPLAINED and self.refusal is None,
            "refusal": self.refusal,
            "effect": self.effect.evidence(),
        }


@dataclass(kw_only=True)
class ScanReport:
    """One listing checked: every effect of payorch's, and how many were someone else's."""

    provider: str
    since: datetime
    until: datetime
    listed: int = 0
    not_ours: int = 0  # effects without payorch's tags: skipped
    findings: list[Finding] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        found = Counter(f.verdict.value for f in self.findings)
        refused = sum(1 for f in self.findings if f.refusal is not None)
        return {
            "listed": self.listed,
            "not_ours": self.not_ours,
            **{v.value: found.get(v.value, 0) for v in Verdict},
            "not_adoptable": refused,
        }


def lister_of(provider: object) -> EffectLister:
    """``provider`` as an :class:`EffectLister`, or ``ListingUnsupported``."""
    if not isinstance(provider, EffectLister):
        name = getattr(provider, "name", type(provider).__name__)
        raise ListingUnsupported(
            f"provider {name!r} cannot list its effects (its adapter has no list_effects), "
            "so effects no operation explains cannot be looked for there"
        )
    return provider


# -- explaining ----------------------------------------------------------------------------


def _lookups(
    store: Store, provider: str, effect: ProviderEffect
) -> Iterator[tuple[str, OperationRecord | None]]:
    """The operations that could explain ``effect``, most specific first (each one read)."""
    tags = effect.tags
    tenant = tags[TAG_TENANT]
    operation, key = tags.get(TAG_OPERATION), tags.get(TAG_KEY)
    if TAG_REF in tags and operation is not None and key is not None:
        try:
            yield "namespace", store.get_by_namespace(tenant, operation, key)
        except OperationNotFound:
            yield "namespace", None
    sent = effect.downstream_key or (downstream_key(tags[TAG_REF]) if TAG_REF in tags else None)
    if sent is not None:
        yield "downstream_key", store.find_by_downstream_key(tenant, provider, sent)
    yield "reference", store.find_by_reference(tenant, provider, effect.provider_reference)
    legacy = tags.get(TAG_LEGACY_OPERATION_ID)
    if legacy is not None:
        try:
            yield "operation_id", store.get(tenant, legacy)
        except OperationNotFound:
            yield "operation_id", None


def explain(store: Store, provider: str, effect: ProviderEffect) -> Finding:
    """Whether an operation explains ``effect`` (one of payorch's: ``effect.ours``)."""
    if not effect.ours:
        raise InvalidRequest(f"effect {effect.provider_reference} carries no payorch tags")
    try:
        for how, found in _lookups(store, provider, effect):
            if found is not None:
                return Finding(
                    provider=provider,
                    effect=effect,
                    verdict=Verdict.EXPLAINED,
                    operation_id=found.id,
                    explained_by=how,
                )
    except CorruptRecord as exc:
        # A row holds it, unreadable: the reconciler quarantines it; nothing to adopt.
        return Finding(
            provider=provider,
            effect=effect,
            verdict=Verdict.EXPLAINED,
            operation_id=exc.operation_id,
            explained_by="corrupt_row",
        )
    return Finding(
        provider=provider,
        effect=effect,
        verdict=Verdict.UNEXPLAINED,
        refusal=adoption_refusal(effect),
    )


def adoption_refusal(effect: ProviderEffect) -> str | None:
    """Why ``effect`` cannot be adopted as its namespace's operation; None if it can (pure)."""
    reason = _tags_refusal(effect.tags)
    if reason is not None:
        return reason
    expected = downstream_key(effect.tags[TAG_REF])
    if effect.downstream_key is not None and effect.downstream_key != expected:
        return f"the provider saw key {effect.downstream_key!r}, not the namespace's {expected!r}"
    if effect.kind not in _ADOPTABLE:
        return f"its status could not be read as an outcome ({effect.kind.value})"
    return None


def _tags_refusal(tags: Mapping[str, str]) -> str | None:
    """Why these tags do not name one namespace and its fingerprint; None if they do."""
    if TAG_REF not in tags:
        return (
            "tagged before keys came from the namespace: its idempotency key and fingerprint "
            "are unknown; settle it by hand"
        )
    missing = [t for t in (TAG_OPERATION, TAG_KEY, TAG_FINGERPRINT) if t not in tags]
    if missing:
        return (
            f"its tags lack {', '.join(missing)} (sent before fingerprints were): a retry "
            "could not be matched to the fields it was made with; settle it by hand"
        )
    try:
        validate_tenant(tags[TAG_TENANT])
        validate_operation_name(tags[TAG_OPERATION])
        validate_idempotency_key(tags[TAG_KEY])
    except InvalidRequest as exc:
        return f"its tags are malformed: {exc.message}"
    if not _FINGERPRINT.fullmatch(tags[TAG_FINGERPRINT]):
        return f"its {TAG_FINGERPRINT} is not a SHA-256 hex digest"
    ref = namespace_ref(tags[TAG_TENANT], tags[TAG_OPERATION], tags[TAG_KEY])
    if tags[TAG_REF] != ref:
        return f"its {TAG_REF} is not its namespace's ({ref}): the tags disagree"
    return None


# -- adopting ------------------------------------------------------------------------------


def _required(value: str | None, name: str, limit: int) -> str:
    text = (value or "").strip()
    if not text:
        raise InvalidRequest(f"an adoption needs a non-empty {name}")
    if len(text) > limit:
        raise InvalidRequest(f"{name} is longer than {limit} characters")
    return text


def _new_operation(
    provider: str, effect: ProviderEffect, registry: Registry | None
) -> NewOperation:
    tags = effect.tags
    operation = tags[TAG_OPERATION]
    known = registry.types.get(operation) if registry is not None else None
    currency = effect.currency.upper() if effect.currency else None  # ISO 4217, as stored
    return NewOperation(
        tenant_id=tags[TAG_TENANT],
        operation=operation,
        idempotency_key=tags[TAG_KEY],
        fingerprint=tags[TAG_FINGERPRINT],
        provider=provider,
        amount=effect.amount,
        currency=currency if currency is not None and len(currency) == 3 else None,
        # A type the registry does not know is kept as long as money movement is.
        retention=known.retention if known is not None else MONEY_RETENTION,
    )


def adopt(
    store: Store,
    finding: Finding,
    *,
    actor: str,
    reason: str,
    registry: Registry | None = None,
) -> Finding:
    """Adopt an unexplained, adoptable finding: the finding as it ends (``ADOPTED``, or
    ``EXPLAINED`` when a client's retry claimed the namespace first). Raises
    ``InvalidRequest`` for a finding that is not adoptable or an empty actor or reason."""
    actor = _required(actor, "actor", MAX_ACTOR)
    reason = _required(reason, "reason", MAX_REASON)
    if finding.verdict is not Verdict.UNEXPLAINED:
        raise InvalidRequest(f"effect {finding.effect.provider_reference} is {finding.verdict}")
    if finding.refusal is not None:
        raise InvalidRequest(
            f"effect {finding.effect.provider_reference} cannot be adopted: {finding.refusal}"
        )
    effect = finding.effect
    new = _new_operation(finding.provider, effect, registry)
    answer = Answer(
        kind=effect.kind,
        provider_reference=effect.provider_reference,
        code=effect.code,
        body=effect.raw,
    )
    decision = decide(answer, first_check=timedelta(0), pending_check=timedelta(0))
    response = None
    if decision.response is not None:
        response = {**decision.response, "resolution": ADOPTED_RESOLUTION}
    detail = {
        "reason": reason,
        "downstream_key": new.downstream_key,
        "evidence": effect.evidence(),
    }
    record = insert_adopted(
        store,
        new,
        replace(decision, response=response),
        provider_reference=effect.provider_reference,
        actor=actor,
        detail=detail,
    )
    if record is None:
        # The client's retry won the namespace: its operation explains the effect now.
        held = store.get_by_namespace(new.tenant_id, new.operation, new.idempotency_key)
        return Finding(
            provider=finding.provider,
            effect=effect,
            verdict=Verdict.EXPLAINED,
            operation_id=held.id,
            explained_by="namespace",
        )
    logs.emit(
        log,
        logging.WARNING,
        "effect.adopted",
        provider=finding.provider,
        reference=effect.provider_reference,
        op=record.id,
        tenant=record.tenant_id,
        state=record.state.value,
        actor=actor,
    )
    return Finding(
        provider=finding.provider,
        effect=effect,
        verdict=Verdict.ADOPTED,
        operation_id=record.id,
    )


def scan(
    store: Store,
    provider: object,
    *,
    since: datetime,
    until: datetime,
    adopt_found: bool = False,
    actor: str | None = None,
    reason: str | None = None,
    registry: Registry | None = None,
) -> ScanReport:
    """List ``provider``'s effects created in ``[since, until]`` and judge each of payorch's;
    with ``adopt_found``, adopt every adoptable unexplained one (``actor`` and ``reason``
    are then required). ``ListingUnsupported`` for an adapter that cannot list;
    ``ProviderListingFailed`` when the listing cannot be read (what was adopted stays)."""
    lister = lister_of(provider)
    if adopt_found:
        actor = _required(actor, "actor", MAX_ACTOR)
        reason = _required(reason, "reason", MAX_REASON)
    report = ScanReport(provider=lister.name, since=since, until=until)
    for effect in lister.list_effects(since, until):
        report.listed += 1
        if not effect.ours:
            report.not_ours += 1
            continue
        finding = explain(store, lister.name, effect)
        if adopt_found and finding.verdict is Verdict.UNEXPLAINED and finding.refusal is None:
            assert actor is not None and reason is not None
            finding = adopt(store, finding, actor=actor, reason=reason, registry=registry)
        report.findings.append(finding)
    return report


@dataclass(kw_only=True)
class UnexplainedWatch:
    """The reconciler daemon's scheduled look (``PAYORCH_UNEXPLAINED_EVERY_SECONDS``): each
    run lists the trailing ``window`` of every provider given, adopting when ``adopt``."""

    store: Store
    providers: Sequence[EffectLister]
    every: timedelta
    window: timedelta
    adopt: bool = False
    actor: str = "reconciler"
    reason: str = "adopted by the reconciler daemon's scheduled look (PAYORCH_UNEXPLAINED_ADOPT)"
    registry: Registry | None = None

    def run(self) -> list[ScanReport]:
        """One look at each provider; a provider that fails is logged and skipped."""
        until = datetime.now(UTC)
        reports = []
        for provider in self.providers:
            try:
                report = scan(
                    self.store,
                    provider,
                    since=until - self.window,
                    until=until,
                    adopt_found=self.adopt,
                    actor=self.actor,
                    reason=self.reason,
                    registry=self.registry,
                )
            except PayorchError as exc:  # the provider or the database is away: next run
                logs.emit(
                    log,
                    logging.WARNING,
                    "unexplained.skipped",
                    provider=provider.name,
                    error=exc.message,
                )
                continue
            level = logging.WARNING if _left_unexplained(report) else logging.INFO
            logs.emit(
                log, level, "unexplained.scanned", provider=report.provider, **report.counts()
            )
            reports.append(report)
        return reports


def _left_unexplained(report: ScanReport) -> bool:
    return any(f.verdict is not Verdict.EXPLAINED for f in report.findings)
