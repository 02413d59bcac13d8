"""The demo's closing report: outcomes, how they were reached, what was flagged and why,
and the invariant counted at the provider (one effect per operation)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

from ..core import State
from ..outcome import WebhookStatus
from ..providers.sandbox import SandboxServer
from ..storage._reads import timeline_order
from ..storage._store import Store
from ..storage._tables import events, operations

if TYPE_CHECKING:
    from ..outcome import Outcome

__all__ = ["MONEY", "Tally", "attention_reasons", "report"]

MONEY = ("succeeded", "processing")


@dataclass
class Tally:
    """What the demo's callers saw, counted as they go; the report checks it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: int = 0
    replays: int = 0
    in_progress_answers: int = 0
    not_sent_answers: int = 0  # ProviderUnavailable: retried with the same key
    reuse_attempts: int = 0
    reuse_refused: int = 0
    first: dict[str, Outcome] = field(default_factory=dict)
    mismatched_replays: list[str] = field(default_factory=list)

    def bump(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)


# Events that say by themselves why an operation was flagged.
_FLAG_KINDS = ("conflicting_evidence", "quarantined")


def _why(kind: str, detail: object, error_code: str | None) -> str | None:
    """The reason one event gives for a flag, or None if it gives none."""
    info = detail if isinstance(detail, dict) else {}
    decision = info.get("decision")
    if kind in _FLAG_KINDS:
        return kind
    if info.get("duplicate"):
        return "duplicate effects at the provider"
    if isinstance(decision, str) and decision.startswith("escalate:"):
        return decision
    if "needs_attention" in info:
        return "still unknown after max checks / max age"
    if kind in ("provider_answer", "resubmission") and error_code:
        return f"provider answer: {error_code}"
    return None


def attention_reasons(conn: sa.Connection, tenant: str) -> Counter[str]:
    """Flagged operations by reason ("<reason> [<state>]"), from the store: the newest event
    that explains the flag, else the operation's error code."""
    flagged = {
        row.id: row
        for row in conn.execute(
            sa.select(operations.c.id, operations.c.state, operations.c.error_code).where(
                operations.c.tenant_id == tenant, operations.c.needs_attention
            )
        )
    }
    reasons: dict[str, str] = {}
    if flagged:
        newest_first = conn.execute(
            sa.select(events.c.operation_id, events.c.kind, events.c.detail)
            .where(events.c.tenant_id == tenant, events.c.operation_id.in_(list(flagged)))
            # Newest as written (database time), not by id: ids come from host clocks.
            .order_by(*timeline_order(conn.dialect.name, newest_first=True))
        )
        for op_id, kind, detail in newest_first:
            if op_id not in reasons:
                why = _why(kind, detail, flagged[op_id].error_code)
                if why is not None:
                    reasons[op_id] = why
    for op_id, row in flagged.items():
        if op_id not in reasons:
            reasons[op_id] = f"error code {row.error_code}" if row.error_code else "no reason"
    return Counter(f"{reasons[op_id]} [{row.state}]" for op_id, row in flagged.items())


def report(
    store: Store,
    sandbox: SandboxServer,
    *,
    tenant: str,
    tally: Tally,
    webhooks: Counter[str],
    console: Console,
    extra: Sequence[tuple[str, int, int]] = (),
) -> bool:
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(
                operations.c.id,
                operations.c.state,
                operations.c.resolution,
                operations.c.downstream_key,
            ).where(operations.c.tenant_id == tenant)
        ).all()
        were_unknown = {
            op_id
            for (op_id,) in conn.execute(
                sa.select(events.c.operation_id).where(
                    events.c.tenant_id == tenant, events.c.to_state == "outcome_unknown"
                )
            )
        }
        failures = Counter(
            code or "-"
            for (code,) in conn.execute(
                sa.select(operations.c.error_code).where(
                    operations.c.tenant_id == tenant, operations.c.state == "failed_final"
                )
            )
        )
        flagged = attention_reasons(conn, tenant)
    states = Counter(r.state for r in rows)
    resolutions = Counter(
        r.resolution or "-" for r in rows if r.state in ("succeeded", "failed_final")
    )
    unknown_resolved = Counter(f"{r.resolution} -> {r.state}" for r in rows if r.id in were_unknown)
    ledger = sandbox.ledger()
    # The provider knows our downstream keys, never our operation ids.
    by_key = {r.downstream_key: r.id for r in rows}
    effects_per_op: Counter[str] = Counter()
    for entry in ledger:
        if entry["status"] in MONEY:
            effects_per_op[by_key.get(entry["idempotency_key"], "-")] += 1
    ids = {r.id for r in rows}
    duplicates = sum(n - 1 for n in effects_per_op.values() if n > 1)
    orphans = sum(n for op, n in effects_per_op.items() if op not in ids)
    wrong = [
        r.id
        for r in rows
        if (r.state == State.SUCCEEDED.value and effects_per_op[r.id] != 1)
        or (r.state == State.FAILED_FINAL.value and effects_per_op[r.id] != 0)
    ]
    unsettled = states["in_progress"] + states["outcome_unknown"]

    table = Table(title="operations by state")
    table.add_column("state")
    table.add_column("count", justify="right")
    for state in State:
        table.add_row(state.value, str(states[state.value]))
    console.print(table)
    how = Table(title="how terminal outcomes were reached")
    how.add_column("resolution")
    how.add_column("count", justify="right")
    for name, n in sorted(resolutions.items()):
        how.add_row(name, str(n))
    console.print(how)
    console.print(f"{len(were_unknown)} operations were outcome_unknown; resolved by:")
    for name, n in sorted(unknown_resolved.items()):
        console.print(f"  {name}: {n}")
    console.print(f"failed_final by reason: {dict(sorted(failures.items()))}")
    console.print(f"webhook deliveries: {dict(sorted(webhooks.items())) or 'none'}")
    console.print(f"needs_attention: {flagged.total()} operations flagged for a human")
    for reason, n in sorted(flagged.items()):
        console.print(f"  {reason}: {n}")
    money_ops = sum(1 for r in rows if r.state == State.SUCCEEDED.value)
    console.print(
        f"provider effects: {sum(effects_per_op.values())} for {money_ops} succeeded "
        f"operations ({len(rows)} operations, {len(ledger)} ledger entries incl. declines)"
    )
    checks = [
        ("duplicate effects", duplicates, 0),
        ("effects without an operation", orphans, 0),
        ("operations whose state and effects disagree", len(wrong), 0),
        ("operations not settled", unsettled, 0),
        ("replays that named another operation", len(tally.mismatched_replays), 0),
        ("changed-amount reuses not refused", tally.reuse_attempts - tally.reuse_refused, 0),
        ("webhook deliveries that conflicted", webhooks[WebhookStatus.CONFLICT.value], 0),
        *extra,
    ]
    ok = True
    for label, value, expected in checks:
        good = value == expected
        ok = ok and good
        mark = "[green]ok[/green]" if good else "[red]BROKEN[/red]"
        console.print(f"  {mark} {label}: {value}")
    console.print(f"duplicates: {duplicates}")
    console.print(
        "[bold green]invariants hold[/bold green]"
        if ok
        else "[bold red]INVARIANT BROKEN[/bold red]"
    )
    return ok
