"""``payorch demo``: a few hundred payments through faults, settled by evidence.

Simulated clients retry, send concurrent duplicates and reuse a key with a changed amount,
against a sandbox acquirer that drops responses after committing, fails with 5xx, resets
connections, rate-limits, declines, lags and leaves payments pending. Then the reconciler
and the webhooks settle everything, the sandbox's settlement report is imported as the
provider's evidence; payments are routed across two more acquirers, one of which goes down
mid-run. The run checks the one invariant that matters: one explainable effect per
operation, counted at the providers and in the settlement.
"""

from __future__ import annotations

import random
import tempfile
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from rich.console import Console

from .. import migrate
from ..errors import IdempotencyKeyReused, OperationInProgress, ProviderUnavailable
from ..execution._executor import Executor, RetryPolicy
from ..operations import default_registry
from ..outcome import Outcome
from ..provider import TAG_TENANT
from ..providers.sandbox import SandboxProvider, SandboxServer
from ..reconciling._reconciler import Reconciler, ReconcilerPolicy
from ..reconciling._webhooks import WebhookHandler
from ..storage._schema import shown_url
from ..storage._store import Store
from ..storage._tables import operations
from ._demo_recon import settle_books
from ._demo_report import Tally, attention_reasons, report
from ._demo_routing import route_across
from ._progress import Update, bar
from ._runtime import err

__all__ = ["attention_reasons", "run_demo"]

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
CLIENT_TIMEOUT = httpx.Timeout(connect=1.0, read=0.5, write=1.0, pool=1.0)
SETTLE_DEADLINE = 45.0  # seconds for the reconciler and webhooks to settle everything


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
    console.print(f"database {shown_url(store.engine.url)}")
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
        # Progress on stderr, drawn only on a terminal: pipes and tests get the report alone.
        with bar("clients", console=err()) as progress:
            _clients(executor, tenant, payments, seed, tally, progress=progress)
        console.print(
            f"clients done in {time.monotonic() - started:.1f}s: {tally.calls} calls, "
            f"{tally.replays} replays, {tally.in_progress_answers} in-progress answers, "
            f"{tally.not_sent_answers} nothing-sent answers, "
            f"{tally.reuse_refused}/{tally.reuse_attempts} changed-amount reuses refused"
        )
        with bar("settling", console=err()) as progress:
            webhook_results = _settle(store, provider, sandbox, seed, tenant, progress=progress)
        books = settle_books(store, sandbox, tenant, console)
        # A tenant of its own: the report above counts the first acquirer's operations.
        books += route_across(store, f"{tenant}-routed", payments, seed, console)
        ok = report(
            store,
            sandbox,
            tenant=tenant,
            tally=tally,
            webhooks=webhook_results,
            console=console,
            extra=books,
        )
    store.close()
    console.print(f"finished in {time.monotonic() - started:.1f}s")
    return ok


def _rates() -> str:
    return ", ".join(f"{k} {v:.0%}" for k, v in FAULT_RATES.items())


def _clients(
    executor: Executor, tenant: str, payments: int, seed: int, tally: Tally, *, progress: Update
) -> None:
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
            except ProviderUnavailable:
                # Nothing was sent and nothing stored: the same key runs again.
                tally.bump("not_sent_answers")
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
        progress(0, len(futures))
        for done, f in enumerate(as_completed(futures), start=1):
            f.result()
            progress(done, len(futures))


def _settle(
    store: Store,
    provider: SandboxProvider,
    sandbox: SandboxServer,
    seed: int,
    tenant: str,
    *,
    progress: Update,
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
    unsettled = _active(store, tenant)  # what the bar counts down
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
        active = _active(store, tenant)
        unsettled = max(unsettled, active)
        progress(unsettled - active, unsettled)
        if active == 0:
            break
        time.sleep(0.2)  # let the next checks fall due
    return results


def json_tenant(body: bytes) -> str | None:
    import json

    data = json.loads(body).get("data", {})
    meta = data.get("metadata") or {}
    tenant = meta.get(TAG_TENANT)
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
