"""``payorch once``: the effects payorch.once escalated, and an operator's decision on one.

An escalated effect (a consumer's message or an idempotent function's call that may have
happened) is never run again by payorch: find out whether it happened (the other
system's log), then ``payorch once resolve`` it; the key's later calls replay the decision.
"""

from __future__ import annotations

import enum
import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from . import _render as render
from ._lazy import lazy_module
from ._runtime import DatabaseUrl, JsonFlag, Tenant, default_actor, err, not_blank, open_store, out

if TYPE_CHECKING:
    from ..once import _operator as effects_operator
    from ..once._values import EffectRecord
else:
    effects_operator = lazy_module("payorch.once._operator")

__all__ = ["once_app"]

MAX_PAGE = 1000  # payorch.once._operator.MAX_PAGE, spelled out so --help imports nothing

once_app = typer.Typer(
    help="Effects done once (payorch.once): list the escalated ones, resolve one.",
    no_args_is_help=True,
)

EffectId = Annotated[str, typer.Argument(help="Effect id.", show_default=False)]


class Resolution(enum.StrEnum):
    SUCCEEDED = "succeeded"
    FAILED_FINAL = "failed_final"


def _json_value(value: str | None) -> str | None:
    if value is not None:
        try:
            json.loads(value)
        except ValueError as exc:
            raise typer.BadParameter(f"not JSON: {exc}") from None
    return value


def _line(record: EffectRecord) -> str:
    error = record.error or {}
    why = error.get("kind", "-")
    what = error.get("type", "-")
    return (
        f"{record.id}  {record.tenant_id}  {record.namespace}  {record.state.value}  "
        f"attempts {record.attempts}  {why} {what}  created {render.fmt_time(record.created_at)}"
    )


@once_app.command("list")
def list_cmd(
    *,
    tenant: Tenant = None,
    namespace: Annotated[str | None, typer.Option(help="Only this namespace.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=MAX_PAGE, help="Page size.")] = 100,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """List the effects waiting for an operator (needs_attention), oldest first."""
    with open_store(database_url) as store:
        found = effects_operator.escalated(
            store, tenant_id=tenant, namespace=namespace, limit=limit
        )
    if json_:
        render.print_json({"items": [r.to_dict() for r in found]})
        return
    console = out()
    if not found:
        console.print("no escalated effects")
    for record in found:
        console.print(Text(render.printable(_line(record))))


@once_app.command("show")
def show_cmd(
    *,
    effect_id: EffectId,
    tenant: Tenant = None,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """Show one effect: its state, attempts, result or error, and any resolution."""
    with open_store(database_url) as store:
        record = effects_operator.find(store, effect_id, tenant_id=tenant)
    if json_:
        render.print_json(record.to_dict())
        return
    console = out()
    console.print(Text(render.printable(_line(record))))
    console.print(Text(f"  key {render.printable(record.key)}"))
    for name in ("result", "error"):
        value = getattr(record, name)
        if value is not None:
            console.print(Text(f"  {name} {render.printable(json.dumps(value, sort_keys=True))}"))


@once_app.command("resolve")
def resolve_cmd(
    *,
    effect_id: EffectId,
    as_: Annotated[
        Resolution,
        typer.Option("--as", help="What the operator established.", show_default=False),
    ],
    reason: Annotated[
        str,
        typer.Option(callback=not_blank, help="Why (kept on the effect).", show_default=False),
    ],
    actor: Annotated[
        str | None,
        typer.Option(callback=not_blank, help="Who decides (default: the login name)."),
    ] = None,
    result: Annotated[
        str | None,
        typer.Option(callback=_json_value, help="The result later calls replay (JSON)."),
    ] = None,
    tenant: Tenant = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """Settle an escalated (or abandoned) effect by an audited decision."""
    who = actor or default_actor()
    if result is not None and as_ is not Resolution.SUCCEEDED:
        raise typer.BadParameter("--result goes with --as succeeded", param_hint="--result")
    with open_store(database_url) as store:
        record = effects_operator.find(store, effect_id, tenant_id=tenant)
        if not yes:
            console = err() if json_ else out()
            console.print(Text(render.printable(_line(record))))
            try:
                confirmed = typer.confirm(f"Resolve as {as_.value} on behalf of {who}?")
            except typer.Abort:
                confirmed = False
            if not confirmed:
                err().print("aborted: nothing changed", markup=False)
                raise typer.Exit(1)
        value: Any = json.loads(result) if result is not None else None
        done = effects_operator.resolve(
            store,
            record.id,
            to=as_.value,
            actor=who,
            reason=reason,
            result=value,
            tenant_id=record.tenant_id,
            expected_version=record.version,
        )
    if json_:
        render.print_json(done.to_dict())
        return
    out().print(Text(f"{done.id}: {record.state.value} -> {done.state.value} by {who}"))
