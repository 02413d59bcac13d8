"""The demo's settlement: the sandbox's report of its ledger (Stripe's itemized format),
imported as the provider's evidence, checked like a finance team would check it."""

from __future__ import annotations

from rich.console import Console

from ..providers.sandbox import SandboxServer
from ..recon import RowClass, import_report
from ..storage._store import Store
from . import _render as render

__all__ = ["settle_books"]

FEE_PER_MILLE, FEE_FIXED = 29, 30  # 2.9% + 0.30: what the sandbox's report charges


def settle_books(
    store: Store, sandbox: SandboxServer, tenant: str, console: Console
) -> list[tuple[str, int, int]]:
    """Import the sandbox's settlement report; the checks it must pass, for the report."""
    data = sandbox.settlement_report(
        batch=1, fee=lambda amount: amount * FEE_PER_MILLE // 1000 + FEE_FIXED
    )
    result = import_report(store, data, provider="sandbox", name="demo-settlement.csv")
    counts = result.counts
    console.print(
        f"settlement report: {len(result.report.rows)} rows in Stripe's itemized format, "
        f"judged {dict(sorted(counts.items()))}"
    )
    for batch in result.batches:
        console.print(
            f"  payout {batch.batch}: {batch.status}, {batch.rows} rows, net "
            f"{render.fmt_amount(batch.net, batch.currency)}"
        )
    batches = result.batches
    again = import_report(store, data, provider="sandbox", name="demo-settlement.csv")
    expected = [i for i in result.expected.items if i.operation.tenant_id == tenant]
    return [
        ("settlement rows that are a second effect", counts.get(RowClass.DUPLICATE, 0), 0),
        ("settlement rows contradicting a final state", counts.get(RowClass.CONTRADICTION, 0), 0),
        ("settlement rows of another amount", counts.get(RowClass.MISMATCH, 0), 0),
        ("settlement rows of no operation", counts.get(RowClass.ORPHAN, 0), 0),
        ("payouts whose rows do not add up", sum(b.status != "balanced" for b in batches), 0),
        ("succeeded operations missing from the report", len(expected), 0),
        ("rows a second import of the report added", again.new_rows, 0),
    ]
