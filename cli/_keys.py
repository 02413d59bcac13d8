"""``payorch keys``: idempotency-key retention."""

from __future__ import annotations

from typing import Annotated

import typer

from . import _render as render
from ._runtime import DatabaseUrl, JsonFlag, open_store, out

__all__ = ["keys_app"]

keys_app = typer.Typer(help="Idempotency keys: retention and tombstones.", no_args_is_help=True)


@keys_app.command("reap")
def reap_cmd(
    *,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would be reaped; change nothing.")
    ] = False,
    limit: Annotated[int, typer.Option(min=1, help="At most this many namespaces.")] = 1000,
    batch: Annotated[int, typer.Option(min=1, max=10000, help="Namespaces per transaction.")] = 100,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant.")] = None,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """Turn namespaces past their retention window into tombstones (bodies dropped).

    A later request with a reaped key gets IdempotencyKeyExpired (HTTP 410); nothing runs.
    """
    with open_store(database_url) as store:
        from ..storage._retention import reap

        report = reap(store, limit=limit, dry_run=dry_run, batch_size=batch, tenant_id=tenant)
    if json_:
        render.print_json(report.to_dict())
    else:
        render.show_reap(out(), report)
