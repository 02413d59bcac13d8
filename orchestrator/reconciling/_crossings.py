"""Routed operations across providers: every provider an operation touched is asked, and an
effect at two providers for one namespace is found, flagged and (by policy) reversed.

A routed operation moves to its next provider only on proof that the current attempt did not
execute (``payorch.routing``). Proofs can still be overturned by the world: an issuer's
stand-in approval after a decline, an effect that surfaces past the provider's window. So each
earlier attempt is asked again under its own downstream key (:meth:`CrossCheck.check`: by the
reconciler after each check of a routed operation, and by :class:`FallbackWatch` after the
operation settled). An effect found there, beside the operation's own, is a cross-provider
duplicate: the operation is flagged (critical), both effects are recorded in one event, and
the :class:`DuplicatePolicy` applies to the later one, the effect the client was not answered
with: ``reverse`` voids it through its provider, or refunds it (a ``refund.create``
operation of its own, audited), or else leaves it to the operator; ``operator`` leaves it.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core import State
from ..errors import PayorchError, StaleVersion
from ..observing import _logs as logs
from ..observing import _metrics as metrics
from ..observing import _routing as routing_metrics
from ..provider import (
    Answer,
    AnswerKind,
    Provider,
    StatusQuery,
    Voider,
    VoidRequest,
    can_query_status,
    can_void,
)
from ..records import EventRecord, OperationRecord, Redactor
from ..routing import key_at, touched
from ..storage._store import Store
from ._cross_flags import (
    ACKNOWLEDGED,
    CROSS_DUPLICATE,
    CROSS_LEFT,
    CROSS_REVERSAL,
    duplicate_detail,
    names_late,
    recorded_late,
    same_late,
)
from ._voids import query_of

if TYPE_CHECKING:
    from ..execution._executor import Executor

__all__ = [
    "CROSS_DUPLICATE",
    "CROSS_LEFT",
    "CROSS_REVERSAL",
    "CrossCheck",
    "DuplicatePolicy",
]

_RACES = 5
_REVERSIBLE = frozenset({"payment.create"})  # what a refund.create can undo


class DuplicatePolicy(enum.StrEnum):
    """What is done about the later of two effects across providers (docs/routing.md)."""

    REVERSE = "reverse"  # void it through its provider, else refund it; else the operator
    OPERATOR = "operator"  # flag it and leave it to the operator


def refund_key(record: OperationRecord, provider: str) -> str:
    """The idempotency key of the refund that reverses ``record``'s effect at ``provider``:
    stable, so a second look never refunds twice."""
    return f"payorch-duplicate:{record.id}:{provider}"


@dataclass(kw_only=True)
class CrossCheck:
    """Asks the providers a routed operation moved away from (``providers``: the app's
    adapters by name) and applies ``policy`` to an effect found there. ``refunds``: the
    executor that runs a reversing ``refund.create`` where a void cannot be had (None:
    voids only, the rest to the operator)."""

    store: Store
    providers: Mapping[str, Provider]
    owner: str
    policy: DuplicatePolicy = DuplicatePolicy.REVERSE
    refunds: Executor | None = None

    def check(self, record: OperationRecord) -> list[str]:
        """Ask each provider the operation left (and each its route passed over as
        unhealthy: a claim lost in a failover may have been sent there) under that
        provider's key; one result per provider asked: ``clear``, ``pending``, ``unchecked``
        (no adapter here, or it cannot be asked), ``busy`` (an executor holds it), or what
        a duplicate came to (``flagged``, ``voided``, ``refunded``, ``left_to_operator``…)."""
        if record.state is State.IN_PROGRESS and record.lease_owner not in (None, self.owner):
            return ["busy"]  # its executor is at work: look again later
        results = []
        for provider, key in self.asked(record):
            adapter = self.providers.get(provider)
            if adapter is not None and not can_query_status(adapter):
                # It cannot be asked; what it told us (a webhook, a settlement row) stands in.
                told = recorded_late(self.store.events(record.tenant_id, record.id), provider, key)
                if told is not None:
                    answer = Answer(kind=AnswerKind.SUCCEEDED, provider_reference=told)
                    record, result = self._found(record, provider, key, answer)
                    results.append(result)
                    continue
            if adapter is None or not can_query_status(adapter):
                self._unchecked(record, provider, "no adapter here that can be asked")
                results.append("unchecked")
                continue
            # By its own key only: the operation's reference is the current provider's.
            query = StatusQuery(
                **{**query_of(record), "downstream_key": key, "provider_reference": None}
            )
            try:
                answer = adapter.query_status(query)
            except Exception as exc:  # noqa: BLE001 - an adapter's bug is evidence of nothing
                self._unchecked(record, provider, f"{type(exc).__name__}: {exc}"[:300])
                results.append("unchecked")
                continue
            answer = Redactor.of(record.request).answer(answer)
            if answer.kind in (AnswerKind.SUCCEEDED, AnswerKind.PENDING):
                record, result = self._found(record, provider, key, answer)
                results.append(result)
            else:
                results.append("clear")
        return results

    @staticmethod
    def asked(record: OperationRecord) -> list[tuple[str, str]]:
        """(provider, downstream key) of every provider to ask about ``record``."""
        current = (record.provider, record.downstream_key)
        pairs = [p for p in touched(record.route) if p != current and p[1]]
        for provider in (record.route or {}).get("skipped") or ():
            key = key_at(record.route or {}, str(provider))
            if key and (provider, key) not in pairs and (provider, key) != current:
                pairs.append((str(provider), key))
        return pairs

    def _unchecked(self, record: OperationRecord, provider: str, why: str) -> None:
        logs.emit(
            logs.reconciler_log,
            logging.WARNING,
            "route.unchecked",
            operation_id=record.id,
            tenant_id=record.tenant_id,
            provider=provider,
            reason=why,
        )

    # -- a duplicate -------------------------------------------------------------------

    def _found(
        self, record: OperationRecord, provider: str, key: str, answer: Answer
    ) -> tuple[OperationRecord, str]:
        reference = answer.provider_reference
        events = self.store.events(record.tenant_id, record.id)
        flags = [
            i
            for i, e in enumerate(events)
            if e.kind == CROSS_DUPLICATE and same_late(e.detail, provider, key, reference)
        ]
        if not flags:
            # A webhook's or a settlement row's flag of it was counted when raised.
            counted = any(names_late(e, provider, key, reference) for e in events)
            record = self._flag(record, provider, key, answer, first=not counted)
        elif not record.needs_attention and not any(
            e.kind == ACKNOWLEDGED for e in events[flags[-1] :]
        ):
            # Settled since (a settling write clears flags): the flag stays until a human
            # acknowledges it, so it is raised again (counted once, when first found).
            record = self._flag(record, provider, key, answer, first=False)
        if answer.kind is AnswerKind.PENDING:
            return record, "flagged"  # not an effect yet: nothing to reverse, look again
        if any(e.kind in (CROSS_REVERSAL, CROSS_LEFT) and _reverses(e, provider, key, reference)
               for e in events):  # fmt: skip
            return record, "known"
        if self.policy is DuplicatePolicy.OPERATOR:
            return record, "flagged"
        if not record.terminal:
            return record, "flagged"  # which effect stands is not known yet: look again
        return record, self._reverse(record, provider, key, answer)

    def _flag(
        self, record: OperationRecord, provider: str, key: str, answer: Answer, *, first: bool
    ) -> OperationRecord:
        late = {
            "provider": provider,
            "downstream_key": key,
            "provider_reference": answer.provider_reference,
            "state": answer.kind.value,
            "evidence": answer.evidence(),
        }
        detail = duplicate_detail(record, late, policy=self.policy.value)
        for _ in range(_RACES):
            try:
                flagged = self.store.flag_attention(
                    record, kind=CROSS_DUPLICATE, actor=self.owner, detail=detail
                )
            except StaleVersion:
                record = self.store.get(record.tenant_id, record.id)
                continue
            if not first:
                return flagged
            if not record.needs_attention:
                metrics.escalated("cross_provider")
            routing_metrics.cross_provider_duplicate(provider)
            logs.emit(
                logs.reconciler_log,
                logging.ERROR,
                "route.cross_provider_duplicate",
                operation_id=record.id,
                tenant_id=record.tenant_id,
                provider=record.provider,
                late_provider=provider,
                late_reference=answer.provider_reference,
                policy=self.policy.value,
            )
            return flagged
        # Still racing: keep the evidence even if the flag could not be fenced in.
        self.store.append_event(record, kind=CROSS_DUPLICATE, actor=self.owner, detail=detail)
        return self.store.get(record.tenant_id, record.id)

    def _reverse(self, record: OperationRecord, provider: str, key: str, answer: Answer) -> str:
        """Void the later effect through its provider, else refund it, else leave it."""
        adapter = self.providers[provider]
        reference = answer.provider_reference
        note: dict[str, Any] = {
            "provider": provider,
            "downstream_key": key,
            "provider_reference": reference,
        }
        if can_void(adapter, reference):
            assert isinstance(adapter, Voider)
            request = VoidRequest(
                **{**query_of(record), "downstream_key": key, "provider_reference": reference},
                reason="cross-provider duplicate",
                actor=self.owner,
            )
            try:
                voided = adapter.void(request)
            except Exception as exc:  # noqa: BLE001 - an adapter's bug is evidence of nothing
                voided = Answer(kind=AnswerKind.AMBIGUOUS, code=type(exc).__name__)
            note["void"] = voided.evidence()
            if voided.kind is AnswerKind.SUCCEEDED:
                self._note(record, CROSS_REVERSAL, {**note, "how": "void"})
                return "voided"
            if voided.kind is AnswerKind.PENDING:
                # Taken, not done: the next look sends the same void (its own key) again.
                self._note(record, "cross_provider_void_pending", note)
                return "void_pending"
        refunds = self.refunds
        if (
            record.operation in _REVERSIBLE
            and refunds is not None
            and reference
            and provider in refunds.providers
        ):
            return self._refund(record, provider, reference, note)
        reason = "it can be neither voided nor refunded here: the operator decides"
        self._note(record, CROSS_LEFT, {**note, "reason": reason})
        return "left_to_operator"

    def _refund(
        self, record: OperationRecord, provider: str, reference: str, note: dict[str, Any]
    ) -> str:
        assert self.refunds is not None
        request: dict[str, Any] = {"payment_intent": reference, "amount": record.amount}
        if record.currency:
            request["currency"] = record.currency
        try:
            outcome = self.refunds.execute(
                tenant_id=record.tenant_id,
                operation="refund.create",
                idempotency_key=refund_key(record, provider),
                request=request,
                provider=provider,
            )
        except PayorchError as exc:
            # Not done now; the same key runs it on the next look (never a second refund).
            note["refund_error"] = f"{type(exc).__name__}: {exc.message}"[:300]
            self.store.append_event(
                record, kind="cross_provider_refund_failed", actor=self.owner, detail=note
            )
            return "refund_failed"
        note.update(
            how="refund",
            refund_operation_id=outcome.operation_id,
            refund_state=outcome.state.value,
            refund_key=refund_key(record, provider),
        )
        if outcome.state is State.SUCCEEDED:
            self._note(record, CROSS_REVERSAL, note)
            return "refunded"
        if outcome.state is State.FAILED_FINAL:
            note["reason"] = f"the refund was declined ({outcome.error_code}): the operator decides"
            self._note(record, CROSS_LEFT, note)
            return "left_to_operator"
        # Unknown or in progress: the refund is an operation of its own, reconciled as any.
        self.store.append_event(record, kind="cross_provider_refund", actor=self.owner, detail=note)
        return "refund_" + outcome.state.value

    def _note(self, record: OperationRecord, kind: str, detail: Mapping[str, Any]) -> None:
        self.store.append_event(record, kind=kind, actor=self.owner, detail=dict(detail))


def _reverses(event: EventRecord, provider: str, key: str, reference: str | None) -> bool:
    """Whether a reversal (or a reversal left to the operator) is about the effect under
    ``key`` at ``provider``: one key makes one effect there, whatever reference names it."""
    detail = event.detail or {}
    if detail.get("provider") not in (None, provider):
        return False
    if detail.get("downstream_key") == key:
        return True
    return reference is not None and detail.get("provider_reference") == reference
