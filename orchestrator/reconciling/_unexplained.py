"""Effects no operation explains: a provider's effects made under payorch's tags, checked
against the store, and adopted as operations flagged for attention.

A claim committed on a primary can vanish in a failover (asynchronous replication); if its
client never comes back, the charge it made is invisible: no operation, nothing for the
reconciler to settle. Listing the provider's effects (:class:`~payorch.provider.EffectLister`)
finds it, and the tags every effect carries (:func:`~payorch.provider.provider_tags`) name
the namespace it was made for.

Each listed effect is judged on its own (a bad one is reported with its reason, the scan
goes on). Its tags are read first: tags payorch could not have sent are *malformed* (the
effect is listed unexplained, never adopted, and nothing is looked up by them). An effect
whose ``payorch_ref`` is not its namespace's under this installation's key scope
(``PAYORCH_KEY_SCOPE``, :func:`~payorch.core.namespace_ref`) was made by another
installation sharing the account: it is *not ours*, skipped with the reason.

An effect is *explained* when an operation of its tenant has its namespace, its downstream
key or its provider reference (an effect tagged before keys came from the namespace: its
operation id), and is of the type the effect stands for (its ``payorch_operation`` tag; for
the earlier tags, the operation they name): a capture or refund holding the same ``pi_…``
explains nothing of the intent's creation. Unless that operation is *released*: it says
nothing was ever sent under it (a client's retry re-created the lost claim and the provider
could not be reached), which the effect contradicts. *Adopting* an unexplained one gives the
namespace the operation its lost claim would have become: the same namespace and
fingerprint, the downstream key re-derived from the namespace (the key the provider saw), in
the state the effect proves (succeeded, failed_final for a decline, outcome_unknown while
pending), flagged for attention, with an ``adopted`` event holding the provider's object
and, settled, the messages the store's outbox hooks stage for it. A namespace no row
holds gets a new row; a released row is moved there by a fenced transition. The client's
retry with the same key and fields then replays that outcome instead of charging again;
other fields get ``IdempotencyKeyReused``. An effect without a fingerprint tag cannot be
adopted: a retry could not be told from another request under the key.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from ..core import downstream_key
from ..errors import (
    CorruptRecord,
    InvalidRequest,
    ListingUnsupported,
    OperationNotFound,
    StaleVersion,
)
from ..observing import _logs as logs
from ..operations import MONEY_RETENTION, Registry
from ..outcome import Decision, decide
from ..provider import (
    TAG_FINGERPRINT,
    TAG_KEY,
    TAG_LEGACY_OPERATION_ID,
    TAG_OPERATION,
    TAG_REF,
    TAG_TENANT,
    Answer,
    EffectLister,
    ProviderEffect,
)
from ..records import NewOperation, OperationRecord
from ..storage._store import Store
from ._adoption import ADOPTED_EVENT, ADOPTED_RESOLUTION, adopt_released, insert_adopted
from ._effect_tags import (
    adoption_refusal,
    foreign_tags,
    installation_scope,
    malformed_tags,
    not_ours,
    routed_at,
    storable,
)
from ._findings import Finding, ScanReport, Skipped, Verdict
from ._operator import required_text
from ._route_effects import beside_route

__all__ = [
    "ADOPTED_EVENT",
    "Finding",
    "ScanReport",
    "Skipped",
    "Verdict",
    "adopt",
    "adoption_refusal",
    "explain",
    "installation_scope",
    "lister_of",
    "not_ours",
    "scan",
]

MAX_ACTOR = 200  # payorch_events.actor
MAX_REASON = 2000
_ADOPT_ATTEMPTS = 3  # a namespace that keeps changing under an adoption: then look again
NOTHING_SENT = "its operation says nothing was sent"

log = logging.getLogger("payorch.unexplained")


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
    """The operations that could explain ``effect`` (its tags well-formed), most specific
    first (each one read)."""
    tags = effect.tags
    tenant = tags[TAG_TENANT]
    operation, key = tags.get(TAG_OPERATION), tags.get(TAG_KEY)
    if TAG_REF in tags and operation is not None and key is not None:
        try:
            yield "namespace", store.get_by_namespace(tenant, operation, key)
        except OperationNotFound:
            yield "namespace", None
    seen = (
        effect.downstream_key if effect.downstream_key and storable(effect.downstream_key) else None
    )
    sent = seen or (downstream_key(tags[TAG_REF]) if TAG_REF in tags else None)
    if sent is not None:
        yield "downstream_key", store.find_by_downstream_key(tenant, provider, sent)
    if storable(effect.provider_reference):
        yield "reference", store.find_by_reference(tenant, provider, effect.provider_reference)
    legacy = tags.get(TAG_LEGACY_OPERATION_ID)
    if legacy is not None:
        try:
            yield "operation_id", store.get(tenant, legacy)
        except OperationNotFound:
            yield "operation_id", None


def _stands_for(record: OperationRecord, effect: ProviderEffect) -> bool:
    """Whether ``record`` is the operation ``effect`` stands for: of the type its tags name
    (an intent's creation is explained by a ``payment.create``, never by the capture or
    refund that holds the same ``pi_…`` as its reference), or, for tags of the earlier form,
    the very operation they name."""
    operation = effect.tags.get(TAG_OPERATION)
    if operation is not None:
        return record.operation == operation
    legacy = effect.tags.get(TAG_LEGACY_OPERATION_ID)
    return legacy is None or record.id == legacy


def _says_nothing_sent(record: OperationRecord, effect: ProviderEffect) -> bool:
    """Whether ``record`` denies ``effect``: released (nothing ever sent under it, nobody
    holds it) and not already knowing the effect by its reference."""
    return record.released and record.provider_reference != effect.provider_reference


def explain(
    store: Store, provider: str, effect: ProviderEffect, *, key_scope: str | None = None
) -> Finding:
    """Whether an operation explains ``effect``, one of this installation's (``InvalidRequest``
    for an effect :func:`not_ours` names a reason for). ``key_scope``: the installation's
    (None: the environment's, as the Executor's)."""
    scope = installation_scope(key_scope)
    if not effect.ours:
        raise InvalidRequest(f"effect {effect.provider_reference} carries no payorch tags")
    malformed = malformed_tags(effect.tags)
    if malformed is not None:
        return Finding(
            provider=provider, effect=effect, verdict=Verdict.UNEXPLAINED, refusal=malformed
        )
    foreign = foreign_tags(effect.tags, scope, provider)
    if foreign is not None:
        raise InvalidRequest(f"effect {effect.provider_reference} is not ours: {foreign}")
    released: OperationRecord | None = None
    routed = routed_at(effect.tags, scope, provider)
    try:
        for how, found in _lookups(store, provider, effect):
            if found is None or not _stands_for(found, effect):
                continue  # another operation on the same object explains nothing of this one
            beside = beside_route(store, found, provider, effect, routed_effect=routed)
            if beside is not None:
                return Finding(
                    provider=provider,
                    effect=effect,
                    verdict=Verdict.UNEXPLAINED,
                    operation_id=found.id,
                    refusal=beside,
                )
            if _says_nothing_sent(found, effect):
                released = released or found
                continue
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
    refusal = adoption_refusal(effect, key_scope=scope)
    if refusal is not None and routed:
        refusal = (
            f"made by a routed attempt at {provider} whose operation is gone (a claim lost "
            "in a failover): its route is not known here; settle it by hand"
        )
    if released is None:
        return Finding(
            provider=provider, effect=effect, verdict=Verdict.UNEXPLAINED, refusal=refusal
        )
    if refusal is None:
        refusal = _held_refusal(released, _new_operation(provider, effect, None, scope))
    return Finding(
        provider=provider,
        effect=effect,
        verdict=Verdict.UNEXPLAINED,
        operation_id=released.id,
        refusal=refusal,
        nothing_sent=True,
    )


def _held_refusal(held: OperationRecord, new: NewOperation) -> str | None:
    """Why the released row holding the namespace cannot become the effect's operation."""
    if held.fingerprint != new.fingerprint:
        return (
            f"its namespace's operation {held.id} was claimed with other fields (another "
            "fingerprint): a retry under either could not be answered; settle it by hand"
        )
    if held.provider != new.provider:
        return f"its namespace's operation {held.id} is for provider {held.provider!r}"
    if held.downstream_key != new.downstream_key:
        return (
            f"its namespace's operation {held.id} sends key {held.downstream_key!r}, not "
            f"the namespace's {new.downstream_key!r}"
        )
    return None


# -- adopting ------------------------------------------------------------------------------


def _new_operation(
    provider: str, effect: ProviderEffect, registry: Registry | None, scope: str
) -> NewOperation:
    tags = effect.tags
    operation = tags[TAG_OPERATION]
    known = registry.types.get(operation) if registry is not None else None
    currency = effect.currency.upper() if effect.currency else None  # ISO 4217, as stored
    return NewOperation(
        tenant_id=tags[TAG_TENANT],
        operation=operation,
        idempotency_key=tags[TAG_KEY],
        fingerprint=tags.get(TAG_FINGERPRINT, ""),
        provider=provider,
        amount=effect.amount,
        currency=currency if currency is not None and len(currency) == 3 else None,
        # A type the registry does not know is kept as long as money movement is.
        retention=known.retention if known is not None else MONEY_RETENTION,
        key_scope=scope,
    )


def _decision(effect: ProviderEffect) -> Decision:
    answer = Answer(
        kind=effect.kind,
        provider_reference=effect.provider_reference,
        code=effect.code,
        body=effect.raw,
    )
    decision = decide(answer, first_check=timedelta(0), pending_check=timedelta(0))
    if decision.response is None:
        return decision
    return replace(decision, response={**decision.response, "resolution": ADOPTED_RESOLUTION})


def _namespace_row(store: Store, new: NewOperation) -> OperationRecord | None:
    try:
        return store.get_by_namespace(new.tenant_id, new.operation, new.idempotency_key)
    except OperationNotFound:
        return None


def adopt(
    store: Store,
    finding: Finding,
    *,
    actor: str,
    reason: str,
    registry: Registry | None = None,
    key_scope: str | None = None,
) -> Finding:
    """Adopt an unexplained, adoptable finding: the finding as it ends.

    ``ADOPTED``: a new row, or the namespace's released row moved (fenced by its version).
    ``EXPLAINED``: a client's retry claimed the namespace, or took its released row over,
    first. ``UNEXPLAINED``: the namespace is now held by a released row that cannot become
    the effect's (``refusal``), or kept changing under the adoption (``note``: look again).
    The namespace is judged again after every lost race. ``key_scope`` is the
    installation's (None: the environment's, as the Executor's): the downstream key is
    derived under it. Raises ``InvalidRequest`` for a finding that is not adoptable or an
    empty actor or reason.
    """
    actor = required_text(actor, "actor", MAX_ACTOR, "an adoption")
    reason = required_text(reason, "reason", MAX_REASON, "an adoption")
    if finding.verdict is not Verdict.UNEXPLAINED:
        raise InvalidRequest(f"effect {finding.effect.provider_reference} is {finding.verdict}")
    effect = finding.effect
    scope = installation_scope(key_scope)
    refusal = finding.refusal or adoption_refusal(effect, key_scope=scope)
    if refusal is not None:
        raise InvalidRequest(f"effect {effect.provider_reference} cannot be adopted: {refusal}")
    new = _new_operation(finding.provider, effect, registry, scope)
    decision = _decision(effect)
    detail: dict[str, Any] = {
        "reason": reason,
        "downstream_key": new.downstream_key,
        "evidence": effect.evidence(),
    }
    for _ in range(_ADOPT_ATTEMPTS):
        try:
            held = _namespace_row(store, new)
        except CorruptRecord as exc:
            return replace(
                finding,
                verdict=Verdict.EXPLAINED,
                operation_id=exc.operation_id,
                explained_by="corrupt_row",
                nothing_sent=False,
            )
        if held is None:
            record = insert_adopted(
                store,
                new,
                decision,
                provider_reference=effect.provider_reference,
                actor=actor,
                detail=detail,
            )
            if record is None:
                continue  # a client's retry claimed the namespace first: judge it again
            return _adopted(finding, record, actor, nothing_sent=False)
        if not _says_nothing_sent(held, effect):
            # The client's retry holds the namespace: its operation explains the effect now.
            return replace(
                finding,
                verdict=Verdict.EXPLAINED,
                operation_id=held.id,
                explained_by="namespace",
                nothing_sent=False,
            )
        refusal = _held_refusal(held, new)
        if refusal is not None:
            return replace(finding, operation_id=held.id, refusal=refusal, nothing_sent=True)
        was = {
            "operation_id": held.id,
            "version": held.version,
            "attempts": held.attempts,
            "error_code": held.error_code,
            "request": dict(held.request) if held.request is not None else None,
        }
        try:
            record = adopt_released(
                store,
                held,
                decision,
                provider_reference=effect.provider_reference,
                actor=actor,
                detail={**detail, "released": was},
            )
        except StaleVersion:
            continue  # a client's retry took it over (or it changed): judge it again
        return _adopted(finding, record, actor, nothing_sent=True)
    return replace(
        finding,
        note="its namespace kept changing while it was adopted; nothing adopted, look again",
    )


def _adopted(
    finding: Finding, record: OperationRecord, actor: str, *, nothing_sent: bool
) -> Finding:
    """The finding adopted as ``record`` (``nothing_sent``: a released row, moved)."""
    logs.emit(
        log,
        logging.WARNING,
        "effect.adopted",
        provider=finding.provider,
        reference=finding.effect.provider_reference,
        op=record.id,
        tenant=record.tenant_id,
        state=record.state.value,
        released=nothing_sent or None,
        actor=actor,
    )
    return Finding(
        provider=finding.provider,
        effect=finding.effect,
        verdict=Verdict.ADOPTED,
        operation_id=record.id,
        nothing_sent=nothing_sent,
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
    key_scope: str | None = None,
    tenant_ids: Collection[str] | None = None,
) -> ScanReport:
    """List ``provider``'s effects created in ``[since, until]`` and judge each of payorch's;
    with ``adopt_found``, adopt every adoptable unexplained one (``actor`` and ``reason``
    are then required). ``key_scope`` is the installation's (None: the environment's, as
    the Executor's): effects made under another are skipped (``ScanReport.skipped``).
    ``tenant_ids`` (a reconciler's shard, as ``Reconciler(tenant_ids=…)``): only effects
    tagged with one of these tenants are judged; the others are counted
    (``ScanReport.other_tenants``), never judged nor adopted. None: every tenant.

    Each effect is judged on its own: one that cannot be (its tags refused by a read) is a
    finding with the reason, and the scan goes on. ``ListingUnsupported`` for an adapter
    that cannot list; ``ProviderListingFailed`` when the listing cannot be read (what was
    adopted stays); a ``StorageError`` when the database is away."""
    lister = lister_of(provider)
    scope = installation_scope(key_scope)
    if adopt_found:
        actor = required_text(actor, "actor", MAX_ACTOR, "an adoption")
        reason = required_text(reason, "reason", MAX_REASON, "an adoption")
    report = ScanReport(provider=lister.name, since=since, until=until)
    for effect in lister.list_effects(since, until):
        report.listed += 1
        if not effect.ours:
            report.not_ours += 1
            continue
        if tenant_ids is not None and effect.tags.get(TAG_TENANT) not in tenant_ids:
            report.other_tenants += 1  # another shard's: its own reconciler's look judges it
            continue
        skip = not_ours(effect, key_scope=scope, provider=lister.name)
        if skip is not None:
            report.not_ours += 1
            report.skipped.append(Skipped(provider=lister.name, effect=effect, reason=skip))
            continue
        report.findings.append(
            _judge(
                store,
                lister.name,
                effect,
                scope=scope,
                adopt_found=adopt_found,
                actor=actor,
                reason=reason,
                registry=registry,
            )
        )
    return report


def _judge(
    store: Store,
    provider: str,
    effect: ProviderEffect,
    *,
    scope: str,
    adopt_found: bool,
    actor: str | None,
    reason: str | None,
    registry: Registry | None,
) -> Finding:
    finding: Finding | None = None
    try:
        finding = explain(store, provider, effect, key_scope=scope)
        if adopt_found and finding.adoptable:
            assert actor is not None and reason is not None
            finding = adopt(
                store, finding, actor=actor, reason=reason, registry=registry, key_scope=scope
            )
    except InvalidRequest as exc:  # this effect only: the others are judged all the same
        logs.emit(
            log,
            logging.WARNING,
            "effect.unjudged",
            provider=provider,
            reference=effect.provider_reference,
            error=exc.message,
        )
        return Finding(
            provider=provider,
            effect=effect,
            verdict=Verdict.UNEXPLAINED,
            operation_id=finding.operation_id if finding is not None else None,
            refusal=f"it could not be judged: {exc.message}",
        )
    return finding
