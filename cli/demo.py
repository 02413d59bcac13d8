"""``payorch demo``: a claim/replay walk-through (the full fault demo builds on it)."""

from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path

from rich.console import Console

from orchestrator import migrate
from orchestrator.core import State
from orchestrator.errors import IdempotencyKeyReused, OperationInProgress
from orchestrator.operations import default_registry
from orchestrator.store import Store


def run_demo(*, database_url: str | None, payments: int, seed: int, console: Console) -> bool:
    url = database_url or f"sqlite:///{Path(tempfile.mkdtemp(prefix='payorch-demo-')) / 'demo.db'}"
    migrate.upgrade(url)
    store = Store.from_url(url)
    reg = default_registry("sandbox")
    ok = True
    try:
        req = {"amount": 1999, "currency": "EUR", "customer": "cus_demo"}
        new = reg.prepare(
            tenant_id="demo",
            operation="payment.create",
            idempotency_key=f"order-{seed}",
            request=req,
        ).new
        first = store.claim(new, owner="demo", lease=timedelta(seconds=30))
        console.print(f"claimed {first.operation.id} ({first.operation.state})")
        try:
            store.claim(new, owner="demo", lease=timedelta(seconds=30))
            ok = False
        except OperationInProgress as exc:
            console.print(f"duplicate while in progress -> 409, retry after {exc.retry_after}s")
        store.transition(first.operation, State.SUCCEEDED, kind="provider_answer", actor="demo")
        replay = store.claim(new, owner="demo", lease=timedelta(seconds=30))
        console.print(
            f"duplicate after success -> replayed={replay.replayed} id={replay.operation.id}"
        )
        ok = ok and replay.replayed and replay.operation.id == first.operation.id
        changed = reg.prepare(
            tenant_id="demo",
            operation="payment.create",
            idempotency_key=f"order-{seed}",
            request={**req, "amount": 2999},
        ).new
        try:
            store.claim(changed, owner="demo", lease=timedelta(seconds=30))
            ok = False
        except IdempotencyKeyReused:
            console.print("same key, changed amount -> 422 IdempotencyKeyReused, nothing executed")
    finally:
        store.close()
    console.print("[green]ok[/green]" if ok else "[red]invariant broken[/red]")
    return ok
