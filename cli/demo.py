"""``payorch demo``: a few hundred payments through faults, settled by evidence.

Simulated clients retry, send concurrent duplicates and reuse a key with a changed amount,
against a sandbox acquirer that drops responses after committing, fails with 5xx, resets
connections, rate-limits, declines, lags and leaves payments pending. Then the reconciler
and the webhooks settle everything, and the run checks the one invariant that matters:
one explainable effect per operation, counted at the provider.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

from payorch import migrate
from payorch.core import State
from payorch.errors import IdempotencyKeyReused, OperationInProgress
from payorch.executor import Executor, RetryPolicy
from payorch.operations import default_registry
from payorch.outcome import Outcome
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciler import Reconciler, ReconcilerPolicy
from payorch.store import Store
from payorch.tables import events, operations
from payorch.webhooks import WebhookHandler, WebhookStatus

__all__ = ["run_demo"]

FAULT_RATES = {
    "drop_after": 0.06,
    "error_500_after": 0.05,
    "error_500_before": 0.03,
    "reset_after": 0.04,
    "rate_limit": 0.06,
    "decline": 0.04,
    "latency": 0.05,
    "pending": 0.03,
}
MONEY = ("succeeded", "processing")
CLIENT_TIMEOUT = httpx.Timeout(connect=1.0, read=0.5, write=1.0, pool=1.0)
SETTLE_DEADLINE = 45.0  # seconds for the reconciler and webhooks to settle everything


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: int = 0
    replays: int = 0
    in_progress_answers: int = 0
    reuse_attempts: int = 0
    reuse_refused: int = 0
    first: dict[str, Outcome] = field(default_factory=dict)
    mismatched_replays: list[str] = field(default_factory=list)

    def bump(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)


def run_demo(*, database_url: str | None, payments: int, seed: int, console: Console) -> bool:
    if database_url is not None:
        return _run(database_url, payments, seed, console)
    # The default: a throwaway SQLite file, removed afterwards.
    with tempfile.TemporaryDirectory(prefix="payorch-demo-") as tmp:
        return _run(f"sqlite:///{Path(tmp) / 'demo.db'}", payments, seed, console)


def _run(url: str, payments: int, seed: int, console: Console) -> bool:
    started = time.monotonic()
    tenant = f"demo-{uuid.uuid4().hex[:8]}"
    migrate.upgrade(url)
    store = Store.from_url(url)
    console.print(f"[bold]payorch demo[/bold]: {payments} payments, seed {seed}, tenant {tenant}")
    console.print(f"database {store.engine.url.render_as_string(hide_password=True)}")
    with (
        SandboxServer(
            seed=seed,
            fault_rates=FAULT_RATES,
            status_lag=timedelta(seconds=0.5),
            settle_after=timedelta(seconds=1),
            drop_hold_seconds=1.0,
        ) as sandbox,
        SandboxProvider(
            base_url=sandbox.url, webhook_secret=sandbox.webhook_secret, timeout=CLIENT_TIMEOUT
        ) as provider,
    ):
        console.print(f"sandbox acquirer on {sandbox.url}, faults {_rates()}")
        executor = Executor(
            store=store,
            providers=[provider],
            registry=default_registry("sandbox"),
            lease=timedelta(seconds=30),
            retry=RetryPolicy(
                max_attempts=4,
                base_delay=0.05,
                max_delay=1.0,
                first_check=timedelta(seconds=0.2),
                pending_check=timedelta(seconds=0.5),
            ),
        )
        tally = Tally()
        _clients(executor, tenant, payments, seed, tally)
        console.print(
            f"clients done in {time.monotonic() - started:.1f}s: {tally.calls} calls, "
            f"{tally.replays} replays, {tally.in_progress_answers} in-progress answers, "
            f"{tally.reuse_refused}/{tally.reuse_attempts} changed-amount reuses refused"
        )
        webhook_results = _settle(store, provider, sandbox, seed, tenant)
        ok = _report(
            store, sandbox, tenant=tenant, tally=tally, webhooks=webhook_results, console=console
        )
    store.close()
    console.print(f"finished in {time.monotonic() - started:.1f}s")
    return ok


def _rates() -> str:
    return ", ".join(f"{k} {v:.0%}" for k, v in FAULT_RATES.items())


def _clients(executor: Executor, tenant: str, payments: int, seed: int, tally: Tally) -> None:
    rnd = random.Random(seed)  # noqa: S311 - a seeded simulation, not security
    plan: list[tuple[str, dict[str, Any], int, bool]] = []
    for i in range(payments):
        request = {
            "amount": rnd.randrange(100, 50_000),
            "currency": rnd.choice(["EUR", "USD", "GBP"]),
            "customer": f"cus_{rnd.randrange(1, 60)}",
        }
        if rnd.random() < 0.03:
            request["payment_method"] = "pm_card_declined"
        copies = 3 if rnd.random() < 0.15 else 1  # concurrent duplicates of one request
        reuse = rnd.random() < 0.05  # later, the same key with another amount
        plan.append((f"order-{i:04d}", request, copies, reuse))

    def one_call(key: str, request: dict[str, Any]) -> Outcome | None:
        for attempt in range(6):  # a client that backs off on 409, within bounds
            tally.bump("calls")
            try:
                return executor.execute(
                    tenant_id=tenant,
                    operation="payment.create",
                    idempotency_key=key,
                    request=request,
                )
            except OperationInProgress:
                tally.bump("in_progress_answers")
                time.sleep(0.05 * (attempt + 1))
        return None

    def client(key: str, request: dict[str, Any], reuse: bool) -> None:
        outcome = one_call(key, request)
        if outcome is not None:
            with tally.lock:
                first = tally.first.setdefault(key, outcome)
                if first.operation_id != outcome.operation_id:
                    tally.mismatched_replays.append(key)
        # The client's own time-out fired: it sends the same request again.
        again = one_call(key, request)
        if again is not None:
            if again.replayed:
                tally.bump("replays")
            if outcome is not None and again.operation_id != outcome.operation_id:
                with tally.lock:
                    tally.mismatched_replays.append(key)
        if reuse:
            tally.bump("reuse_attempts")
            try:
                executor.execute(
                    tenant_id=tenant,
                    operation="payment.create",
                    idempotency_key=key,
                    request={**request, "amount": request["amount"] + 1},
                )
            except IdempotencyKeyReused:
                tally.bump("reuse_refused")

    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [
            pool.submit(client, key, request, reuse and copy == 0)
            for key, request, copies, reuse in plan
            for copy in range(copies)
        ]
        for f in futures:
            f.result()


def _settle(
    store: Store, provider: SandboxProvider, sandbox: SandboxServer, seed: int, tenant: str
) -> Counter[str]:
    """Reconciler passes plus webhook deliveries (some lost, some repeated, out of order)."""
    rnd = random.Random(seed + 1)  # noqa: S311 - a seeded simulation
    reconciler = Reconciler(
        store=store,
        providers=[provider],
        tenant_ids=[tenant],  # a shared database: never touch other tenants' payments
        policy=ReconcilerPolicy(
            lease=timedelta(seconds=20),
            batch_size=100,
            not_found_grace=timedelta(seconds=2),
            base_delay=0.2,
            max_delay=1.0,
            max_checks=200,
        ),
    )
    handler = WebhookHandler(store=store, providers=[provider])
    results: Counter[str] = Counter()
    delivered = 0
    deadline = time.monotonic() + SETTLE_DEADLINE
    while time.monotonic() < deadline:
        deliveries = sandbox.webhook_deliveries()[delivered:]
        delivered += len(deliveries)
        batch = [d for d in deliveries if rnd.random() < 0.6]  # 40 % of webhooks are lost
        batch += [d for d in batch if rnd.random() < 0.3]  # and some arrive twice
        rnd.shuffle(batch)
        for d in batch:
            owner = json_tenant(d.body)
            if owner is None:
                continue
            results[handler.handle(owner, "sandbox", d.headers, d.body).status.value] += 1
        reconciler.reconcile_once()
        if _active(store, tenant) == 0:
            break
        time.sleep(0.2)  # let the next checks fall due
    return results


def json_tenant(body: bytes) -> str | None:
    import json

    data = json.loads(body).get("data", {})
    meta = data.get("metadata") or {}
    tenant = meta.get("tenant_id")
    return tenant if isinstance(tenant, str) else None


def _active(store: Store, tenant: str) -> int:
    with store.engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count())
                .select_from(operations)
                .where(
                    operations.c.tenant_id == tenant,
                    operations.c.state.in_(("in_progress", "outcome_unknown")),
                )
            ).scalar_one()
        )


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
            .order_by(events.c.id.desc())
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


def _report(
    store: Store,
    sandbox: SandboxServer,
    *,
    tenant: str,
    tally: Tally,
    webhooks: Counter[str],
    console: Console,
) -> bool:
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(operations.c.id, operations.c.state, operations.c.resolution).where(
                operations.c.tenant_id == tenant
            )
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
    effects_per_op: Counter[str] = Counter()
    for entry in ledger:
        if entry["status"] in MONEY:
            effects_per_op[str((entry.get("metadata") or {}).get("operation_id"))] += 1
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
