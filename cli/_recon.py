"""``payorch recon``: settlement reports imported as evidence, and what they prove.

``import`` reads each file whole (a file that cannot be read is refused in one line naming
its row and column, nothing of it imported, and the command exits 1 after the others);
``report`` shows per file and batch the rows' classes, the rows to act on, and the
operations still expected; ``adopt`` adopts an orphan row whose tags name its namespace.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ..errors import PayorchError, SettlementAccountMismatch, SettlementReportInvalid
from . import _render as render
from ._lazy import lazy_module
from ._runtime import (
    DatabaseUrl,
    JsonFlag,
    close_adapters,
    default_actor,
    duration_option,
    err,
    not_blank,
    open_store,
    out,
    provider_settings,
)

if TYPE_CHECKING:
    from .. import recon
    from ..recon import ImportResult, ReconReport
else:
    recon = lazy_module("payorch.recon")

__all__ = ["recon_app"]

recon_app = typer.Typer(
    help="Settlement reports: import the provider's files, see what they prove.",
    no_args_is_help=True,
)

DEFAULT_LAG = "3d"
Provider = Annotated[
    str,
    typer.Option(
        help="The provider the operations were made with (sandbox, stripe, adyen, or the "
        "app's adapter's name).",
        show_default=False,
    ),
]
Account = Annotated[
    str | None,
    typer.Option(
        help="The merchant account the files must be for (default: the configured Adyen "
        "merchant account for adyen; else what the file names).",
        show_default=False,
    ),
]
Lag = Annotated[
    timedelta | None,
    duration_option(
        "How long a succeeded operation may be missing from every report before it is "
        "flagged overdue.",
        default=DEFAULT_LAG,
    ),
]


def _policy(lag: timedelta | None) -> Any:
    return recon.ReconPolicy(settlement_lag=lag or timedelta(days=3))


def _account(provider: str, account: str | None) -> str | None:
    """The account to check files against: the option, else the merchant account of the
    app's adapter of that name (``PAYORCH_PROVIDERS``), else, for adyen, the configured one."""
    if account is not None:
        return account
    try:
        config = provider_settings()
    except PayorchError:
        return None
    if config.providers:
        from ._adapters import load_providers

        adapters = load_providers(config.providers, "PAYORCH_PROVIDERS")
        try:
            chosen = next((a for a in adapters if a.name == provider), None)
            held = getattr(chosen, "merchant_account", None)
            return held if isinstance(held, str) and held else None
        finally:
            close_adapters(adapters)
    return config.adyen_merchant_account if provider == "adyen" else None


def _money(amount: int | None, currency: str | None) -> str:
    return render.fmt_amount(amount, currency)


def _batch_line(batch: Any) -> str:
    paid = "no payout row yet"
    if batch.paid is not None:
        paid = f"paid {_money(batch.paid, batch.currency)}"
    diff = batch.difference
    off = f", off by {_money(diff, batch.currency)}" if diff else ""
    return (
        f"batch {batch.batch} {batch.currency}: {batch.status} ({batch.rows} rows, net "
        f"{_money(batch.net, batch.currency)}, {paid}{off})"
    )


def _reference(own: str | None, payment: str | None) -> str:
    """A row's references: its payment's first, then its own where that differs (Adyen's
    capture or refund modification)."""
    if payment and own and own != payment:
        return f"{payment} / {own}"
    return payment or own or "-"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {name}" for name, n in sorted(counts.items())) or "nothing new"


def _import_line(result: ImportResult) -> str:
    report = result.report
    known = "" if result.new_file else " (imported before)"
    account = f", account {result.account}" if result.account else ""
    expected = result.expected
    return (
        f"{report.name}{known}: {report.format} {report.kind}{account}; {len(report.rows)} "
        f"rows, {result.new_rows} new; judged: {_counts(result.counts)}; expected "
        f"{len(expected.items)} ({expected.overdue} overdue)"
    )


def _import_json(result: ImportResult) -> dict[str, Any]:
    return {
        "file": result.report.name,
        "digest": result.report.digest,
        "provider": result.provider,
        "account": result.account,
        "format": result.report.format,
        "kind": result.report.kind,
        "rows": len(result.report.rows),
        "new_file": result.new_file,
        "new_rows": result.new_rows,
        "counts": result.counts,
        "flagged": [
            {
                "row": v.row_key,
                "class": v.klass.value,
                "operation_id": v.operation.id if v.operation else None,
                "tenant_id": v.operation.tenant_id if v.operation else None,
                "detail": {k: val for k, val in v.detail.items() if k != "raw"},
            }
            for v in result.verdicts
            if v.klass.flagged or v.klass is recon.RowClass.ORPHAN
        ],
        "batches": [b.to_dict() for b in result.batches],
        "expected": len(result.expected.items),
        "overdue": result.expected.overdue,
    }


@recon_app.command("import")
def import_cmd(
    files: Annotated[
        list[Path], typer.Argument(help="Report files (CSV), each imported whole or not at all.")
    ],
    *,
    provider: Provider,
    format: Annotated[
        str | None,
        typer.Option(
            help="The report format: stripe (itemized balance / payout reconciliation) or "
            "adyen (Settlement details); default: the provider's (sandbox: stripe).",
            show_default=False,
        ),
    ] = None,
    account: Account = None,
    lag: Lag = None,
    actor: Annotated[
        str | None, typer.Option(callback=not_blank, help="Who imports (kept in audit events).")
    ] = None,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """Import settlement report files: each row is stored once and judged against the
    operations (an unknown settled as evidence, a contradiction or a second effect flagged).

    Importing a file again, or files that overlap, changes nothing. A file that cannot be
    read is refused whole, in one line naming its row and column; the command then exits 1.
    """
    chosen = recon.report_format(provider, format)  # a clear refusal before the database
    expected_account = _account(provider, account)
    policy = _policy(lag)
    who = actor or f"recon:{default_actor()}"
    results: list[ImportResult] = []
    failed = 0
    with open_store(database_url) as store:
        for path in files:
            try:
                result = recon.import_report(
                    store,
                    path,
                    provider=provider,
                    format=chosen,
                    account=expected_account,
                    name=str(path),
                    policy=policy,
                    actor=who,
                )
            except (SettlementReportInvalid, SettlementAccountMismatch) as exc:
                # One line per refused file (nothing of it imported); the others go on.
                err().print(f"error: {' '.join(exc.message.split())}", markup=False)
                failed += 1
                continue
            results.append(result)
            if not json_:
                _show_import(result)
    if json_:
        render.print_json({"imports": [_import_json(r) for r in results], "refused": failed})
    if failed:
        raise typer.Exit(1)


def _show_import(result: ImportResult) -> None:
    console = out()
    console.print(Text(_import_line(result)))
    for batch in result.batches:
        style = "red" if batch.status == "unbalanced" else None
        console.print(Text("  " + _batch_line(batch), style=style or ""))
    for verdict in result.verdicts:
        if verdict.klass.flagged or verdict.klass is recon.RowClass.ORPHAN:
            op = verdict.operation.id if verdict.operation is not None else "no operation"
            extra = verdict.detail.get("references") or verdict.detail.get("mismatch") or ""
            crossed = verdict.detail.get("cross_provider")
            if isinstance(crossed, dict):
                extra = (
                    f"at {crossed.get('provider')} ({crossed.get('reference')}), the operation "
                    f"is at {crossed.get('operation_provider')}"
                )
            known = bool(verdict.detail.get("known"))
            if known:
                extra = f"{extra}; known, already flagged".lstrip("; ")
            line = f"  {verdict.klass.value}: row {verdict.row_key} -> {op} {extra}".rstrip()
            style = "red" if verdict.klass.flagged and not known else ""
            console.print(Text(render.printable(line), style=style))


def _show_report(report: ReconReport) -> None:
    console = out()
    if not report.files:
        console.print("no settlement report imported")
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("file", "provider", "account", "format", "rows", "new", "classes"):
        table.add_column(name, no_wrap=True)
    for f in report.files:
        table.add_row(
            Text(render.printable(f.name)),
            f.provider,
            f.account or "-",
            f"{f.format} {f.kind}",
            str(f.rows),
            str(f.new_rows),
            _counts(dict(f.counts)),
        )
    render.print_wide(console, table)
    for batch in report.batches:
        style = "red" if batch.status == "unbalanced" else ""
        console.print(Text(f"{batch.provider} " + _batch_line(batch), style=style))
    if report.listed:
        rows = Table(box=None, header_style="bold", pad_edge=False)
        for name in ("class", "row", "file:line", "reference", "amount", "operation", "note"):
            rows.add_column(name, no_wrap=True)
        for r in report.listed:
            note = r.detail.get("references") or r.detail.get("mismatch") or ""
            if r.klass == "orphan":
                adopted = r.detail.get("adopted_as")
                note = f"adopted as {adopted}" if adopted else r.refusal or "adoptable"
            rows.add_row(
                r.klass,
                r.row_key,
                Text(render.printable(f"{r.file}:{r.line}")),
                _reference(r.reference, r.payment_reference),
                _money(r.amount, r.currency),
                r.operation_id or "-",
                Text(render.printable(str(note))),
                style="red" if r.klass != "orphan" else None,
            )
        render.print_wide(console, rows)
        if report.truncated:
            console.print("(more rows to act on than listed: narrow with --file)")
    for check in report.expected:
        overdue = [i for i in check.items if i.overdue]
        console.print(
            Text(
                f"{check.provider}: {len(check.items)} succeeded operations not in any report "
                f"yet, {len(overdue)} past the settlement lag",
                style="red" if overdue else "",
            )
        )
        for item in overdue[:50]:
            op = item.operation
            console.print(
                Text(
                    f"  overdue: {op.tenant_id}/{op.id} {op.operation} {op.provider_reference} "
                    f"{_money(op.amount, op.currency)} succeeded {render.fmt_time(op.completed_at)}"
                ),
                style="red",
            )
    console.print(Text(f"rows: {_counts(dict(report.counts))}"))


@recon_app.command("report")
def report_cmd(
    *,
    provider: Annotated[
        str | None, typer.Option(help="Only this provider's files.", show_default=False)
    ] = None,
    account: Annotated[
        str | None, typer.Option(help="Only this merchant account's files.", show_default=False)
    ] = None,
    file: Annotated[
        str | None,
        typer.Option(help="Only the file whose digest starts so (see --json).", show_default=False),
    ] = None,
    lag: Lag = None,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """Per file and batch: the rows' classes, the batch totals checked, the rows to act on
    (duplicates, contradictions, mismatches, orphans) and the operations still expected."""
    with open_store(database_url) as store:
        report = recon.build_report(
            store, provider=provider, account=account, digest=file, policy=_policy(lag)
        )
    if json_:
        render.print_json(report.to_dict())
    else:
        _show_report(report)


@recon_app.command("adopt")
def adopt_cmd(
    row: Annotated[str, typer.Argument(help="The orphan row's key (see recon report).")],
    *,
    provider: Provider,
    account: Annotated[
        str, typer.Option(help="The row's merchant account, as the report shows it.")
    ] = "",
    actor: Annotated[
        str, typer.Option(callback=not_blank, help="Who adopts (kept in the audit event).")
    ],
    reason: Annotated[str, typer.Option(callback=not_blank, help="Why (kept in the event).")],
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """Adopt an orphan row as the operation its lost claim would have become (flagged for
    attention): the client's retry with the same key then replays it instead of charging."""
    from ..operations import default_registry

    with open_store(database_url) as store:
        finding = recon.adopt_orphan(
            store,
            provider,
            row,
            account=account,
            actor=actor,
            reason=reason,
            registry=default_registry(),
        )
    if json_:
        render.print_json(finding.to_dict())
        return
    verb = "adopted as" if finding.verdict.value == "adopted" else "explained by"
    out().print(Text(f"row {row}: {verb} {finding.operation_id}"))
