"""``payorch ops``: find, understand and resolve operations."""

from __future__ import annotations

import enum
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from ..core import State
from ..errors import InvalidRequest
from . import _render as render
from ._lazy import lazy_module
from ._runtime import (
    DatabaseUrl,
    JsonFlag,
    Tenant,
    default_actor,
    duration_option,
    err,
    not_blank,
    open_store,
    out,
    reconciler,
    settings,
)

if TYPE_CHECKING:
    from ..reconciling import _operator as operator
    from ..reconciling._reconciler import Reconciler
    from ..records import OperationRecord
    from ..storage import _queries as queries
    from ..storage._store import Store
else:
    operator = lazy_module("payorch.reconciling._operator")
    queries = lazy_module("payorch.storage._queries")

__all__ = ["ops_app"]

# storage._queries.MAX_PAGE, spelled out so that --help imports nothing heavy
MAX_PAGE = 1000

ops_app = typer.Typer(help="Find, understand and resolve payment operations.", no_args_is_help=True)


class Resolution(enum.StrEnum):
    SUCCEEDED = "succeeded"
    FAILED_FINAL = "failed_final"


def _cursor(value: str | None) -> str | None:
    if value is not None:
        try:
            queries.decode_cursor(value)
        except InvalidRequest as exc:
            raise typer.BadParameter(exc.message) from None
    return value


OperationId = Annotated[str, typer.Argument(help="Operation id.", show_default=False)]


def _with_age(record: OperationRecord, now: datetime) -> dict[str, Any]:
    return {**record.to_dict(), "age_seconds": (now - record.created_at).total_seconds()}


@ops_app.command("list")
def list_cmd(
    *,
    database_url: DatabaseUrl = None,
    state: Annotated[State | None, typer.Option(help="Only this state.")] = None,
    tenant: Tenant = None,
    operation: Annotated[
        str | None, typer.Option(help="Only this operation type, e.g. payment.create.")
    ] = None,
    provider: Annotated[str | None, typer.Option(help="Only this provider.")] = None,
    older_than: Annotated[
        timedelta | None,
        duration_option("Only operations created at least this long ago: 30s, 15m, 2h, 1d."),
    ] = None,
    needs_attention: Annotated[
        bool, typer.Option("--needs-attention", help="Only operations flagged for a human.")
    ] = False,
    reference: Annotated[
        str | None,
        typer.Option(help="The provider's id for the effect (e.g. a pi_… from its dashboard)."),
    ] = None,
    key: Annotated[str | None, typer.Option(help="The client's idempotency key.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=MAX_PAGE, help="Page size.")] = 50,
    after: Annotated[
        str | None,
        typer.Option(callback=_cursor, help="Continue after this cursor (printed with a page)."),
    ] = None,
    json_: JsonFlag = False,
) -> None:
    """List operations, newest first (a red row or `!` means it needs attention).

    A row that cannot be read (corrupt) is left out with a one-line warning on stderr, and
    listed under "unreadable" with --json; the others are printed as usual.
    """
    with open_store(database_url) as store:
        page = queries.list_operations(
            store,
            state=state,
            tenant_id=tenant,
            operation=operation,
            provider=provider,
            older_than=older_than,
            needs_attention=True if needs_attention else None,
            provider_reference=reference,
            idempotency_key=key,
            limit=limit,
            cursor=after,
        )
    warn = err()
    for exc in page.unreadable:
        warn.print(render.unreadable_line(exc), markup=False, highlight=False)
    if json_:
        render.print_json(
            {
                "now": page.now.isoformat(),
                "items": [_with_age(r, page.now) for r in page.items],
                "has_more": page.has_more,
                "next_cursor": page.next_cursor,
                "unreadable": [
                    {"tenant_id": e.tenant_id, "id": e.operation_id, "problem": e.problem}
                    for e in page.unreadable
                ],
            }
        )
    else:
        render.show_page(out(), page)


def _locate(
    store: Store,
    operation_id: str | None,
    tenant: str | None,
    operation: str | None,
    key: str | None,
) -> tuple[OperationRecord, datetime]:
    if operation_id is not None:
        if key is not None or operation is not None:
            raise typer.BadParameter(
                "give an operation id or --tenant/--operation/--key, not both",
                param_hint="ID",
            )
        return operator.load(store, tenant, operation_id)
    if tenant is None or operation is None or key is None:
        raise typer.BadParameter(
            "give an operation id, or all of --tenant, --operation and --key", param_hint="ID"
        )
    record = store.get_by_namespace(tenant, operation, key)
    return operator.load(store, record.tenant_id, record.id)


@ops_app.command("show")
def show_cmd(
    *,
    operation_id: Annotated[
        str | None, typer.Argument(help="Operation id.", show_default=False)
    ] = None,
    tenant: Tenant = None,
    operation: Annotated[str | None, typer.Option(help="Operation type (with --key).")] = None,
    key: Annotated[str | None, typer.Option(help="Idempotency key (with --tenant).")] = None,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """Show an operation and its whole timeline: attempts, checks, decisions, with evidence."""
    with open_store(database_url) as store:
        record, now = _locate(store, operation_id, tenant, operation, key)
        timeline = store.events(record.tenant_id, record.id)
    if json_:
        render.print_json(
            {
                "now": now.isoformat(),
                "operation": _with_age(record, now),
                "events": [e.to_dict() for e in timeline],
            }
        )
    else:
        render.show_operation(out(), record, timeline, now)


@ops_app.command("recheck")
def recheck_cmd(
    *,
    operation_id: OperationId,
    tenant: Tenant = None,
    actor: Annotated[
        str | None,
        typer.Option(callback=not_blank, help="Who asks (default: the login name)."),
    ] = None,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """Query the provider now and apply the evidence, as the reconciler would."""
    who = actor or default_actor()
    _act_and_show(
        "check",
        lambda store, rec, record: operator.recheck(
            store, rec, record.tenant_id, record.id, actor=who
        ),
        who=who,
        operation_id=operation_id,
        tenant=tenant,
        database_url=database_url,
        json_=json_,
    )


def _act_and_show(
    what: str,
    act: Callable[[Store, Reconciler, OperationRecord], operator.RecheckResult],
    *,
    who: str,
    operation_id: str,
    tenant: str | None,
    database_url: str | None,
    json_: bool,
) -> None:
    """Run an operator action with a reconciler of the settings' adapters; print what it
    did and the events it wrote."""
    with (
        open_store(database_url) as store,
        reconciler(store, settings(), owner=f"operator:{who}") as rec,
    ):
        record, _ = operator.load(store, tenant, operation_id)
        seen = {e.id for e in store.events(record.tenant_id, record.id)}
        result = act(store, rec, record)
        timeline = [e for e in store.events(record.tenant_id, record.id) if e.id not in seen]
    after = result.record
    if json_:
        render.print_json(
            {
                "outcome": result.outcome,
                "from_state": result.before.state.value,
                "operation": after.to_dict(),
                "events": [e.to_dict() for e in timeline],
            }
        )
        return
    console = out()
    console.print(
        Text(
            f"{after.id}: {result.before.state.value} -> {after.state.value} "
            f"({what}: {result.outcome}); provider ref {after.provider_reference or '-'}"
        )
    )
    for row in render.event_rows(timeline):
        console.print(Text(f"  {row['time']}  {row['kind']}  by {row['actor']}  {row['evidence']}"))


@ops_app.command("void")
def void_cmd(
    *,
    operation_id: OperationId,
    reason: Annotated[
        str,
        typer.Option(callback=not_blank, help="Why (kept in the audit event).", show_default=False),
    ],
    actor: Annotated[
        str | None,
        typer.Option(
            callback=not_blank, help="Who decides (default: the login name).", show_default=False
        ),
    ] = None,
    tenant: Tenant = None,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """Void an unknown authorisation at the provider (audited), instead of leaving it held."""
    who = actor or default_actor()
    _act_and_show(
        "void",
        lambda store, rec, record: operator.void(
            store, rec, record.tenant_id, record.id, reason=reason, actor=who
        ),
        who=who,
        operation_id=operation_id,
        tenant=tenant,
        database_url=database_url,
        json_=json_,
    )


@ops_app.command("resolve")
def resolve_cmd(
    *,
    operation_id: OperationId,
    as_: Annotated[
        Resolution,
        typer.Option("--as", help="The outcome the operator establishes.", show_default=False),
    ],
    reason: Annotated[
        str,
        typer.Option(callback=not_blank, help="Why (kept in the audit event).", show_default=False),
    ],
    actor: Annotated[
        str,
        typer.Option(
            callback=not_blank, help="Who decides (kept in the audit event).", show_default=False
        ),
    ],
    provider_reference: Annotated[
        str | None, typer.Option(help="The provider's id for the effect, if known.")
    ] = None,
    tenant: Tenant = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    database_url: DatabaseUrl = None,
) -> None:
    """Settle an outcome_unknown (or abandoned in_progress) operation by an audited decision."""
    target = State(as_.value)
    with open_store(database_url) as store:
        record, now = operator.load(store, tenant, operation_id)
        operator.check_resolvable(record, now)  # refuse before asking, not after
        console = out()
        if not yes:
            amount = render.fmt_amount(record.amount, record.currency)
            console.print(
                Text(
                    f"{record.id} {record.operation} {amount}"
                    f" tenant {record.tenant_id}: {record.state.value}, "
                    f"{record.checks} checks, provider ref {record.provider_reference or '-'}"
                )
            )
            try:
                confirmed = typer.confirm(
                    f"Resolve as {target.value} on behalf of {actor}?", default=False
                )
            except typer.Abort:
                confirmed = False
            if not confirmed:
                err().print("aborted: nothing changed", markup=False)
                raise typer.Exit(1)
        updated = operator.resolve(
            store,
            record.tenant_id,
            record.id,
            to=target,
            reason=reason,
            actor=actor,
            provider_reference=provider_reference,
            expected_version=record.version,
        )
        audit = [
            e
            for e in store.events(updated.tenant_id, updated.id)
            if e.kind == operator.RESOLUTION_EVENT
        ]
    console.print(
        Text(
            f"{updated.id}: {record.state.value} -> {updated.state.value} by {actor}; "
            f"audit event {audit[-1].id if audit else '?'}"
        )
    )


@ops_app.command("ack")
def ack_cmd(
    *,
    operation_id: OperationId,
    reason: Annotated[
        str,
        typer.Option(callback=not_blank, help="Why (kept in the audit event).", show_default=False),
    ],
    actor: Annotated[
        str,
        typer.Option(
            callback=not_blank, help="Who decides (kept in the audit event).", show_default=False
        ),
    ],
    tenant: Tenant = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """Acknowledge a flagged terminal operation: clear needs_attention, keep its state."""
    with open_store(database_url) as store:
        record, _ = operator.load(store, tenant, operation_id)
        operator.check_acknowledgeable(record)  # refuse before asking, not after
        if not yes:
            # With --json the prompt goes to stderr, so stdout stays one JSON document.
            console = err() if json_ else out()
            amount = render.fmt_amount(record.amount, record.currency)
            console.print(
                Text(
                    f"{record.id} {record.operation} {amount} tenant {record.tenant_id}: "
                    f"{record.state.value}, NEEDS ATTENTION, provider ref "
                    f"{record.provider_reference or '-'} (see `payorch ops show {record.id}`)"
                )
            )
            try:
                confirmed = typer.confirm(
                    f"Acknowledge on behalf of {actor}? The state stays {record.state.value}",
                    default=False,
                    err=json_,
                )
            except typer.Abort:
                confirmed = False
            if not confirmed:
                err().print("aborted: nothing changed", markup=False)
                raise typer.Exit(1)
        updated = operator.acknowledge(
            store,
            record.tenant_id,
            record.id,
            reason=reason,
            actor=actor,
            expected_version=record.version,
        )
        audit = [
            e
            for e in store.events(updated.tenant_id, updated.id)
            if e.kind == operator.ACKNOWLEDGED_EVENT
        ]
    if json_:
        render.print_json(
            {
                "operation": updated.to_dict(),
                "event": audit[-1].to_dict() if audit else None,
            }
        )
        return
    out().print(
        Text(
            f"{updated.id}: acknowledged by {actor}; state stays {updated.state.value}, "
            f"no longer needs attention; audit event {audit[-1].id if audit else '?'}"
        )
    )
