"""Judging a settlement row: which operation it is the effect of, and what it proves.

Each row that is an effect payorch makes (a capture, a refund) is matched to an operation
by the provider's reference, then by payorch's downstream key (Adyen's merchant reference),
then by the key of an attempt a routed operation moved away from, then by the payorch tags
its metadata columns carry; then classified (:class:`RowClass`). A row of an attempt its
routed operation left is never that operation's effect: a cross-provider duplicate.
What it proves is applied to the operation in the transaction that records the row's class:
an unknown operation is settled as a status query's evidence would settle it (audited as
``resolution=settlement``); a final state it contradicts is flagged, never rewritten; a
second effect for one namespace is flagged with both references.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy.engine import Connection

from ..core import State, downstream_key
from ..errors import CorruptRecord, OperationNotFound, StaleVersion
from ..observing import _logs as logs
from ..observing import _metrics as metrics
from ..observing import _routing as routing_metrics
from ..outcome import settled
from ..provider import TAG_KEY, TAG_OPERATION, TAG_REF, TAG_TENANT, Answer, AnswerKind
from ..provider.settlement._rows import Entry
from ..reconciling._cross_flags import cross_flag_open
from ..reconciling._moved import LOOKBACK, left_here, moved_from
from ..reconciling._route_effects import known_duplicate
from ..records import OperationRecord
from ..routing import key_at
from ..storage._engine import run_in_transaction
from ..storage._store import Store
from ..storage._tables import operations
from . import _ledger as ledger

__all__ = ["RESOLUTION", "ReconPolicy", "RowClass", "Verdict", "judge_pending"]

RESOLUTION = "settlement"  # the resolution of an operation a settlement row settled
_ATTEMPTS = 3  # an operation that keeps changing under a judgement: judged again
_PLAIN_BATCH = 500  # rows recorded per transaction when nothing else is written

log = logging.getLogger("payorch.recon")


class RowClass(enum.StrEnum):
    """What a settlement row is, against the operations (docs/reconciliation.md)."""

    MATCHED = "matched"  # the effect of a succeeded operation, same amount and currency
    MISMATCH = "mismatch"  # of a succeeded operation, another amount or currency: flagged
    SETTLES_UNKNOWN = "settles_unknown"  # settled an unknown operation as its evidence
    CONTRADICTION = "contradiction"  # of an operation that failed finally: flagged
    DUPLICATE = "duplicate"  # a second effect for one namespace: flagged critical
    ORPHAN = "orphan"  # no operation's: listed, adoptable when its tags allow
    OTHER = "other"  # fees, payouts, chargebacks, corrections: in the batch's sum

    @property
    def flagged(self) -> bool:
        return self in _FLAGGED


_FLAGGED = frozenset({RowClass.MISMATCH, RowClass.CONTRADICTION, RowClass.DUPLICATE})
# The events a settlement flags an operation with (a later settling row keeps the flag).
_SETTLEMENT_FLAGS = frozenset(f"settlement_{c.value}" for c in _FLAGGED)


@dataclass(frozen=True, kw_only=True)
class ReconPolicy:
    """How settlement rows meet operations.

    ``operations``: per kind of row, the operation types whose effect it can be, preferred
    first (a capture's ``pi_…`` is held by its ``payment.capture`` and by the
    ``payment.create`` it captured); ``payments``: those that hold the payment's reference,
    not a capture's own. ``expected``: the operation types a report must show
    once they succeed; ``settlement_lag``: how long after succeeding one may be missing from
    every report before it is flagged."""

    operations: Mapping[Entry, Sequence[str]] = field(
        default_factory=lambda: {
            Entry.CAPTURE: ("payment.capture", "payment.create"),
            Entry.REFUND: ("refund.create",),
        }
    )
    # The operation types that hold their payment's reference (a capture row names its
    # payment and, where it has one, the capture's own; a payment.capture holds the latter).
    payments: Sequence[str] = ("payment.create",)
    expected: Sequence[str] = ("payment.create", "payment.capture", "refund.create")
    settlement_lag: timedelta = timedelta(days=3)
    # How far before a report's earliest row a routed operation may have moved away from the
    # report's provider, its attempt there still booked in the report (a late approval, then
    # its capture): the moves read to match such rows.
    moved_lookback: timedelta = LOOKBACK


@dataclass(frozen=True)
class Verdict:
    """A row's class, the operation it was matched to, and what was written about it."""

    row_key: str
    klass: RowClass
    operation: OperationRecord | None
    detail: Mapping[str, Any]


class _Candidates:
    """The operations each row may be the effect of, read in bulk for the whole file."""

    def __init__(
        self,
        store: Store,
        provider: str,
        rows: Sequence[Mapping[str, Any]],
        lookback: timedelta = LOOKBACK,
    ) -> None:
        refs: set[str] = set()
        keys: set[str] = set()
        for row in rows:
            refs.update(r for r in (row["reference"], row["payment_reference"]) if r)
            keys.update(k for k in (row["merchant_reference"], _tag_key(row), _paid_key(row)) if k)
        t = operations.c
        self.by_reference = ledger.by_column(store, provider, t.provider_reference, refs)
        self.by_key = ledger.by_column(store, provider, t.downstream_key, keys)
        # Keys no operation here holds: maybe an attempt a routed operation moved on from.
        unheld = keys - self.by_key.keys()
        since = min(row["booked_at"] for row in rows) - lookback
        self.left = moved_from(store, provider, unheld, since) if unheld else {}
        self.store = store

    def find(
        self, row: Mapping[str, Any], policy: ReconPolicy
    ) -> tuple[OperationRecord | None, str | None]:
        entry = Entry(row["entry"])
        wanted = tuple(policy.operations.get(entry, ()))
        refs = [row["reference"]]
        if entry is Entry.CAPTURE:
            refs.append(row["payment_reference"])
        tries: list[tuple[str, list[OperationRecord]]] = [
            ("reference", [op for ref in refs if ref for op in self.by_reference.get(ref, [])]),
            ("downstream_key", list(self.by_key.get(row["merchant_reference"] or "", []))),
            ("downstream_key", list(self.by_key.get(_tag_key(row) or "", []))),
            # A separate capture's row names its payment's key too: the authorisation.
            ("downstream_key", list(self.by_key.get(_paid_key(row) or "", []))),
            # An attempt its routed operation moved on from, by the key it was sent with.
            ("attempt_key", list(self.left.get(row["merchant_reference"] or "", []))),
            ("attempt_key", list(self.left.get(_tag_key(row) or "", []))),
            ("namespace", self._namespace(row)),
        ]
        # The operation type the row prefers wins over the order it was found in: a separate
        # capture's row finds the authorisation by its payment's reference first, and its
        # own payment.capture (not answered yet) by the capture's key.
        found = [(how, op) for how, ops in tries for op in ops]
        for operation in wanted:
            for how, op in found:
                if op.operation == operation:
                    return op, how
        return (found[0][1], found[0][0]) if found and not wanted else (None, None)

    def _namespace(self, row: Mapping[str, Any]) -> list[OperationRecord]:
        tags = _tags(row)
        tenant, operation, key = tags.get(TAG_TENANT), tags.get(TAG_OPERATION), tags.get(TAG_KEY)
        if not (tenant and operation and key):
            return []
        try:
            return [self.store.get_by_namespace(tenant, operation, key)]
        except (OperationNotFound, CorruptRecord):
            return []


def _tags(row: Mapping[str, Any]) -> Mapping[str, str]:
    detail = row.get("detail") or {}
    tags = detail.get("tags") if isinstance(detail, Mapping) else None
    return tags if isinstance(tags, Mapping) else {}


def _paid_key(row: Mapping[str, Any]) -> str | None:
    detail = row.get("detail") or {}
    key = detail.get("payment_merchant_reference") if isinstance(detail, Mapping) else None
    return key if isinstance(key, str) and key else None


def _tag_key(row: Mapping[str, Any]) -> str | None:
    ref = _tags(row).get(TAG_REF)
    try:
        return downstream_key(ref) if ref else None
    except ValueError:
        return None


def _summary(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row as evidence on the operation's event log."""
    return {
        "row": row["row_key"],
        "file": row["file_digest"],
        "line": row["line"],
        "category": row["category"],
        "batch": row["batch"],
        "reference": row["reference"],
        "payment_reference": row["payment_reference"],
        "merchant_reference": row["merchant_reference"],
        "amount": row["amount"],
        "currency": row["currency"],
        "booked_at": row["booked_at"].isoformat(),
    }


def _same_effect(record: OperationRecord, row: Mapping[str, Any]) -> bool:
    refs = {row["reference"]}
    if Entry(row["entry"]) is Entry.CAPTURE:
        refs.add(row["payment_reference"])
    return record.provider_reference is None or record.provider_reference in refs


def _crossed(record: OperationRecord, provider: str, row: Mapping[str, Any]) -> dict[str, Any]:
    """Where the two effects of a namespace stand, when a row of ``provider`` names an
    operation at another provider."""
    return {
        "provider": provider,
        "reference": row["reference"],
        "payment_reference": row["payment_reference"],
        "attempt_key": key_at(record.route, provider) if record.route else None,
        "operation_provider": record.provider,
        "operation_reference": record.provider_reference,
    }


def _reference_for(record: OperationRecord, row: Mapping[str, Any], policy: ReconPolicy) -> str:
    """The reference an operation settled by ``row`` takes: a payment's for a payment."""
    if Entry(row["entry"]) is Entry.CAPTURE and record.operation in policy.payments:
        return str(row["payment_reference"] or row["reference"])
    return str(row["reference"] or row["payment_reference"])


def _mismatch(record: OperationRecord, row: Mapping[str, Any]) -> str | None:
    currency, amount = row["currency"], row["amount"]
    if record.currency and currency and record.currency.upper() != currency:
        return f"currency {currency}, the operation's is {record.currency}"
    if record.amount is not None and amount is not None and record.amount != amount:
        return f"amount {amount}, the operation's is {record.amount}"
    return None


class Judge:
    """Judges one account's pending rows against the store (one instance per import)."""

    def __init__(
        self, store: Store, provider: str, account: str, policy: ReconPolicy, actor: str
    ) -> None:
        self.store = store
        self.provider = provider
        self.account = account
        self.policy = policy
        self.actor = actor
        # The operations as this import last wrote or read them (the bulk read's, at first):
        # a row settles on that version, and a lost compare-and-set reads it again.
        self.latest: dict[tuple[str, str], OperationRecord] = {}
        # Rows whose class writes nothing else, recorded a batch per transaction.
        self.plain: list[dict[str, Any]] = []

    def flush(self) -> None:
        """Record the plain rows judged so far (one transaction per batch)."""
        while self.plain:
            batch, self.plain = self.plain[:_PLAIN_BATCH], self.plain[_PLAIN_BATCH:]
            run_in_transaction(
                self.store.engine, functools.partial(ledger.record_judged, params=batch)
            )

    def judge(self, row: Mapping[str, Any], candidates: _Candidates) -> Verdict | None:
        """The row's verdict, written; None when another import judged it first."""
        try:
            return self._judge(row, candidates)
        except ledger.AlreadyJudged:
            return None

    def _judge(self, row: Mapping[str, Any], candidates: _Candidates) -> Verdict:
        entry = Entry(row["entry"])
        if not entry.effect:
            return self._record(row, RowClass.OTHER, None, {})
        found, how = candidates.find(row, self.policy)
        if found is None:
            return self._record(row, RowClass.ORPHAN, None, {"note": "no operation's effect"})
        key = (found.tenant_id, found.id)
        record: OperationRecord | None = self.latest.get(key, found)
        for _ in range(_ATTEMPTS):
            if record is None:
                break
            try:
                verdict = self._apply(row, record, how or "reference")
            except StaleVersion:
                # Written since it was read: judge it again as it stands now.
                try:
                    record = self.store.get(found.tenant_id, found.id)
                except OperationNotFound:
                    record = None
                continue
            if verdict.operation is not None:
                self.latest[key] = verdict.operation
            return verdict
        note = "its operation kept changing while it was judged; look again"
        return self._record(row, RowClass.ORPHAN, None, {"note": note})

    def _apply(self, row: Mapping[str, Any], record: OperationRecord, how: str) -> Verdict:
        detail: dict[str, Any] = {"matched_by": how}
        evidence = {"settlement": _summary(row), "matched_by": how}
        if record.provider != self.provider:
            elsewhere = self._elsewhere(row, record, detail, evidence)
            if elsewhere is not None:
                return elsewhere
        if not _same_effect(record, row):
            detail["references"] = [record.provider_reference, row["reference"]]
            evidence["references"] = detail["references"]
            evidence["decision"] = "a second effect for one namespace: flagged"
            return self._flag(row, record, RowClass.DUPLICATE, detail, evidence)
        wrong = _mismatch(record, row)
        if wrong is not None:
            detail["mismatch"] = evidence["mismatch"] = wrong
        if record.state is State.FAILED_FINAL:
            detail["conflicts_with"] = evidence["conflicts_with"] = record.state.value
            evidence["decision"] = "a settled effect of an operation that failed: flagged"
            return self._flag(row, record, RowClass.CONTRADICTION, detail, evidence)
        if not record.terminal:
            return self._settle(row, record, detail, evidence, flag=wrong is not None)
        if wrong is not None:
            evidence["decision"] = "settled with another amount or currency: flagged"
            return self._flag(row, record, RowClass.MISMATCH, detail, evidence)
        return self._record(row, RowClass.MATCHED, record, detail)

    def _elsewhere(
        self, row: Mapping[str, Any], record: OperationRecord, detail: dict[str, Any],
        evidence: dict[str, Any],
    ) -> Verdict | None:  # fmt: skip
        """A row of the namespace at a provider its operation is not at: never evidence of
        its outcome there. An attempt it moved on from (on proof that turned out wrong) is
        a cross-provider duplicate, whatever state the operation stands in; an operation
        still open elsewhere (a report imported under another name?) is listed, unchanged;
        a settled one is judged as before (None)."""
        if not left_here(record, self.provider):
            if record.terminal:
                return None
            note = f"names operation {record.id}, which stands at {record.provider}"
            return self._record(row, RowClass.ORPHAN, None, {**detail, "note": note})
        crossed = _crossed(record, self.provider, row)
        detail["cross_provider"] = evidence["cross_provider"] = crossed
        refs = {row["reference"], row["payment_reference"]} - {None}
        if any(known_duplicate(self.store, record, self.provider, r) for r in refs):
            # The reconciler found it first, flagged it and applied its policy.
            detail["known"] = "the operation records this cross-provider duplicate"
            return self._record(row, RowClass.DUPLICATE, record, detail)
        evidence["decision"] = "an effect at a provider the operation is not at: flagged"
        verdict = self._flag(
            row, record, RowClass.DUPLICATE, detail, evidence, reason="cross_provider"
        )
        routing_metrics.cross_provider_duplicate(self.provider)
        return verdict

    def _record(
        self, row: Mapping[str, Any], klass: RowClass, record: OperationRecord | None,
        detail: Mapping[str, Any],
    ) -> Verdict:  # fmt: skip
        kept = {**(row.get("detail") or {}), **detail}
        self.plain.append(
            ledger.judged((self.provider, self.account, row["row_key"]), klass, record, kept)
        )
        if len(self.plain) >= _PLAIN_BATCH:
            self.flush()
        return Verdict(row["row_key"], klass, record, kept)

    def _also(
        self, row: Mapping[str, Any], klass: RowClass, detail: Mapping[str, Any]
    ) -> Callable[[Connection, OperationRecord], None]:
        kept = {**(row.get("detail") or {}), **detail}

        def write(conn: Connection, record: OperationRecord) -> None:
            where = (self.provider, self.account, row["row_key"])
            ledger.record_one_judged(conn, ledger.judged(where, klass, record, kept))

        return write

    def _flag(
        self, row: Mapping[str, Any], record: OperationRecord, klass: RowClass,
        detail: dict[str, Any], evidence: dict[str, Any], *, reason: str = "evidence",
    ) -> Verdict:  # fmt: skip
        if not record.needs_attention:
            metrics.escalated(reason)  # a settlement row a human must look at
        flagged = self.store.flag_attention(
            record,
            kind=f"settlement_{klass.value}",
            actor=self.actor,
            detail=evidence,
            also=self._also(row, klass, detail),
        )
        logs.emit(
            log,
            logging.WARNING if klass is not RowClass.DUPLICATE else logging.ERROR,
            f"recon.{klass.value}",
            provider=self.provider,
            row=row["row_key"],
            op=record.id,
            tenant=record.tenant_id,
            reference=row["reference"],
        )
        return Verdict(row["row_key"], klass, flagged, {**(row.get("detail") or {}), **detail})

    def _flagged_by_settlement(self, record: OperationRecord) -> bool:
        if not record.needs_attention:
            return False
        return any(
            e.kind in _SETTLEMENT_FLAGS for e in self.store.events(record.tenant_id, record.id)
        )

    def _settle(
        self, row: Mapping[str, Any], record: OperationRecord, detail: dict[str, Any],
        evidence: dict[str, Any], *, flag: bool,
    ) -> Verdict:  # fmt: skip
        # Another amount or currency: settled all the same (the money moved), and listed.
        klass = RowClass.MISMATCH if flag else RowClass.SETTLES_UNKNOWN
        ref = record.provider_reference or _reference_for(record, row, self.policy)
        decision = settled(Answer(kind=AnswerKind.SUCCEEDED, provider_reference=ref))
        assert decision is not None
        evidence["decision"] = "a settled effect: the operation succeeded"
        after = self.store.transition(
            record,
            State.SUCCEEDED,
            kind=RESOLUTION,
            actor=self.actor,
            detail=evidence,
            provider_reference=ref,
            response=decision.response,
            error_code=None,
            resolution=RESOLUTION,
            checks_delta=1,
            # Settled by evidence: nothing left for a human, unless the amounts differ or
            # a settlement flagged it before (a second effect found in an earlier file).
            # A cross-provider duplicate's flag stays until acknowledged, raised or not.
            needs_attention=flag
            or self._flagged_by_settlement(record)
            or cross_flag_open(self.store, record),
            also=self._also(row, klass, detail),
        )
        logs.transition(record, after, RESOLUTION, evidence, logger=log)
        if after.needs_attention and not record.needs_attention:
            metrics.escalated("evidence")
        return Verdict(
            row["row_key"],
            klass,
            after,
            {**(row.get("detail") or {}), **detail},
        )


def judge_pending(
    store: Store, provider: str, account: str, policy: ReconPolicy, actor: str
) -> list[Verdict]:
    """Judge every row of the account not judged yet (this import's, and any an earlier
    import left when it stopped), in booking order."""
    rows = ledger.pending(store, provider, account)
    if not rows:
        return []
    candidates = _Candidates(store, provider, rows, policy.moved_lookback)
    judge = Judge(store, provider, account, policy, actor)
    try:
        verdicts = (judge.judge(row, candidates) for row in rows)
        return [v for v in verdicts if v is not None]
    finally:
        judge.flush()  # what was judged is kept, even when a later row fails
