"""``payorch routing check``: the routing table, checked against the configured adapters.

The table an app's integration loads (``PAYORCH_ROUTING``, or ``--file``) is refused here as
it would be at the app's start-up: one line naming the rule and what is wrong with it (a
provider not configured, a split that does not add up to 100%), exit 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from ..errors import ConfigurationError
from . import _render as render
from ._runtime import JsonFlag, build_providers, close_adapters, out, settings

if TYPE_CHECKING:
    from ..routing import Rule

__all__ = ["routing_app"]

routing_app = typer.Typer(
    help="Routing across providers: check the routing table.", no_args_is_help=True
)


@routing_app.command("check")
def check_cmd(
    *,
    file: Annotated[
        Path | None,
        typer.Option(
            "--file",
            help="A routing table (TOML or JSON); default PAYORCH_ROUTING.",
            show_default=False,
        ),
    ] = None,
    registry: Annotated[
        str | None,
        typer.Option(
            "--registry",
            help="Your app's Registry (module:attribute), to check the operation types the "
            "rules name too, as the app's start-up does.",
            show_default=False,
        ),
    ] = None,
    json_: JsonFlag = False,
) -> None:
    """Check the routing table against the configured adapters (PAYORCH_PROVIDERS) and
    show its rules in the order they are tried."""
    from ..routing import load_router
    from ._types import load_registry

    path = file or (Path(p) if (p := settings().routing) else None)
    if path is None:
        raise ConfigurationError("no routing table: pass --file or set PAYORCH_ROUTING")
    router = load_router(path)
    providers = build_providers()
    try:
        types = load_registry(registry).types if registry is not None else None
        router.check({p.name for p in providers}, types)
    finally:
        close_adapters(providers)
    rows = [
        {
            "operation": rule.operation,
            "rule": rule.label,
            "providers": " > ".join(rule.providers),
            "split": ", ".join(f"{p} {share:g}%" for p, share in (rule.split or {}).items()) or "-",
            "matches": _conditions(rule),
        }
        for rule in router.rules
    ]
    declines = sorted(router.fallback_declines)
    if json_:
        render.print_json({"file": str(path), "rules": rows, "fallback_declines": declines})
        return
    table = Table(title=f"routing table {path}: ok", box=None, header_style="bold")
    for name in ("operation", "rule", "providers", "split", "matches"):
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*(Text(v) for v in row.values()))
    out().print(table)
    listed = ", ".join(declines) or "none (a decline is final)"
    out().print(Text(f"declines that move on: {listed}"))


def _conditions(rule: Rule) -> str:
    parts = []
    if rule.currencies is not None:
        parts.append("currency " + "|".join(sorted(rule.currencies)))
    if rule.min_amount is not None or rule.max_amount is not None:
        parts.append(f"amount {rule.min_amount or 0}..{rule.max_amount or ''}")
    if rule.tenants is not None:
        parts.append("tenant " + "|".join(sorted(rule.tenants)))
    parts.extend(f"{k}={v}" for k, v in rule.fields.items())
    return ", ".join(parts) or "all"
