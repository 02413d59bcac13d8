"""``payorch effects``: provider effects made under payorch's tags that no operation explains."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ..errors import InvalidRequest, UnknownProvider
from . import _render as render
from ._lazy import lazy_module
from ._runtime import (
    DatabaseUrl,
    JsonFlag,
    build_providers,
    close_adapters,
    err,
    not_blank,
    open_store,
    out,
    parse_duration,
)

if TYPE_CHECKING:
    from ..reconciling import _unexplained as unexplained
    from ..reconciling._unexplained import Finding, ScanReport
    from ..storage._store import Store
else:
    unexplained = lazy_module("payorch.reconciling._unexplained")

__all__ = ["effects_app", "parse_when"]

effects_app = typer.Typer(
    help="Provider effects made under payorch's keys that no operation explains.",
    no_args_is_help=True,
)


def parse_when(text: str) -> datetime:
    """An ISO 8601 time (UTC unless it says otherwise), or a duration before now: ``24h``."""
    value = text.strip()
    try:
        return datetime.now(UTC) - parse_duration(value)
    except typer.BadParameter:
        pass
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} is neither an ISO 8601 time (2024-05-01T12:00Z) nor a duration (24h)"
        ) from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def _row(finding: Finding) -> dict[str, str]:
    effect = finding.effect
    tags = effect.tags
    if finding.verdict is unexplained.Verdict.ADOPTED:
        verdict = f"adopted as {finding.operation_id}"
        if finding.nothing_sent:
            verdict += f" (it was released: {unexplained.NOTHING_SENT})"
    elif finding.verdict is unexplained.Verdict.EXPLAINED:
        verdict = f"explained by {finding.operation_id}"
    else:
        # A released operation of its namespace says nothing was sent: the effect denies it.
        verdict = "unexplained"
        if finding.nothing_sent:
            verdict += f" ({unexplained.NOTHING_SENT}: {finding.operation_id})"
        if finding.refusal is not None:
            verdict += f", not adoptable: {finding.refusal}"
        else:
            verdict += ", adoptable"
        if finding.note:
            verdict += f"; {finding.note}"
    return {
        "created": render.fmt_time(effect.created_at),
        "reference": effect.provider_reference,
        "status": effect.kind.value,
        "amount": render.fmt_amount(effect.amount, effect.currency),
        "tenant": tags.get("payorch_tenant_id", "-"),
        "operation": tags.get("payorch_operation", "-"),
        "key": tags.get("payorch_idempotency_key", tags.get("payorch_operation_id", "-")),
        "verdict": verdict,
    }


def _summary(report: ScanReport) -> str:
    c = report.counts()
    refused = f" ({c['not_adoptable']} not adoptable)" if c["not_adoptable"] else ""
    adopted = f", {c['adopted']} adopted" if c["adopted"] else ""
    scoped = f" ({c['other_scope']} under another key scope)" if c["other_scope"] else ""
    return (
        f"{report.provider}: {c['listed']} effects created {render.fmt_time(report.since)} "
        f"to {render.fmt_time(report.until)}; {c['not_ours']} not payorch's{scoped}, "
        f"{c['explained']} explained, {c['unexplained']} unexplained{refused}{adopted}"
    )


def _show(report: ScanReport) -> None:
    console = out()
    shown = [f for f in report.findings if f.verdict is not unexplained.Verdict.EXPLAINED]
    if shown:
        table = Table(box=None, header_style="bold", pad_edge=False)
        for name in _row(shown[0]):
            table.add_column(name, no_wrap=True)
        for finding in shown:
            style = "red" if finding.verdict is unexplained.Verdict.UNEXPLAINED else None
            cells = (Text(render.printable(v)) for v in _row(finding).values())
            table.add_row(*cells, style=style)
        render.print_wide(console, table)
    console.print(Text(_summary(report)))


def _json(report: ScanReport) -> dict[str, Any]:
    return {
        "provider": report.provider,
        "since": report.since.isoformat(),
        "until": report.until.isoformat(),
        "counts": report.counts(),
        "findings": [f.to_dict() for f in report.findings],
        "skipped": [s.to_dict() for s in report.skipped],
    }


@effects_app.command("unexplained")
def unexplained_cmd(
    *,
    provider: Annotated[
        str,
        typer.Option(
            help="The provider to list (sandbox, or stripe when configured).", show_default=False
        ),
    ],
    since: Annotated[
        datetime,
        typer.Option(
            parser=parse_when,
            metavar="WHEN",
            help="Effects created from: an ISO 8601 time, or a duration before now (24h).",
            show_default=False,
        ),
    ],
    until: Annotated[
        datetime | None,
        typer.Option(
            parser=parse_when, metavar="WHEN", help="Effects created up to (default: now)."
        ),
    ] = None,
    adopt: Annotated[
        bool,
        typer.Option(
            "--adopt",
            help="Adopt each adoptable one as an operation flagged for attention "
            "(needs --actor and --reason).",
        ),
    ] = False,
    actor: Annotated[
        str | None,
        typer.Option(callback=not_blank, help="Who adopts (kept in each audit event)."),
    ] = None,
    reason: Annotated[
        str | None,
        typer.Option(callback=not_blank, help="Why (kept in each audit event)."),
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """List the provider's effects made under payorch's tags that no operation explains.

    An effect is explained when an operation of its tenant holds its namespace, its
    downstream key or its provider reference, unless that operation is released (it says
    nothing was sent). --adopt gives each unexplained one whose tags name its whole
    namespace and fingerprint the operation its lost claim would have become (succeeded,
    failed_final or outcome_unknown, as the effect shows), flagged for attention: the
    client's retry with the same key then replays it. Effects made under another
    installation's key scope (PAYORCH_KEY_SCOPE) are skipped.
    """
    end = until or datetime.now(UTC)
    if since > end:
        raise typer.BadParameter("--since must not be later than --until", param_hint="--since")
    if adopt and (actor is None or reason is None):
        raise typer.BadParameter("--adopt needs --actor and --reason", param_hint="--adopt")
    # The installation's key scope, as its Executors read it: refs and keys derive from it.
    key_scope = unexplained.installation_scope()
    providers = build_providers()
    try:
        chosen = next((p for p in providers if p.name == provider), None)
        if chosen is None:
            names = ", ".join(p.name for p in providers)
            raise UnknownProvider(
                f"no provider named {provider!r} is configured (have: {names}); run the "
                "tools with the app's adapters: PAYORCH_PROVIDERS=module:attribute"
            )
        lister = unexplained.lister_of(chosen)  # before the database: a clear refusal first
        with open_store(database_url) as store:
            report = unexplained.scan(store, lister, since=since, until=end, key_scope=key_scope)
            if adopt:
                _adopt(
                    store,
                    report,
                    actor=actor or "",
                    reason=reason or "",
                    key_scope=key_scope,
                    yes=yes,
                    json_=json_,
                )
    finally:
        close_adapters(providers)
    if json_:
        render.print_json(_json(report))
    else:
        _show(report)


def _adopt(
    store: Store,
    report: ScanReport,
    *,
    actor: str,
    reason: str,
    key_scope: str,
    yes: bool,
    json_: bool,
) -> None:
    """Adopt the report's adoptable findings in place, after a confirmation unless ``yes``."""
    from ..operations import default_registry

    todo = [i for i, f in enumerate(report.findings) if f.adoptable]
    if not todo:
        return
    if not yes:
        # With --json the prompt goes to stderr, so stdout stays one JSON document.
        console = err() if json_ else out()
        for i in todo:
            console.print(Text(" ".join(_row(report.findings[i]).values())))
        try:
            confirmed = typer.confirm(
                f"Adopt {len(todo)} effects as operations flagged for attention, "
                f"on behalf of {actor}?",
                default=False,
                err=json_,
            )
        except typer.Abort:
            confirmed = False
        if not confirmed:
            err().print("aborted: nothing adopted", markup=False)
            raise typer.Exit(1)
    registry = default_registry()
    for i in todo:
        finding = report.findings[i]
        try:
            report.findings[i] = unexplained.adopt(
                store, finding, actor=actor, reason=reason, registry=registry, key_scope=key_scope
            )
        except InvalidRequest as exc:  # this one only: the others are adopted all the same
            report.findings[i] = replace(finding, refusal=f"it could not be adopted: {exc.message}")
