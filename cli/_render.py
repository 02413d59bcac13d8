"""How operations, timelines and reports look: rich tables for people, JSON for scripts.

Every value that comes from the database is wrapped in ``Text`` so that a tenant id or a
reason containing ``[brackets]`` is printed, never read as rich markup, and passed through
:func:`printable` so that a string no encoding can carry (a lone surrogate) is escaped, not
fatal. Rows that cannot be read at all are named in one line each on stderr.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ..errors import CorruptRecord

if TYPE_CHECKING:
    from ..records import EventRecord, OperationRecord
    from ..storage._queries import Page, Stats
    from ..storage._retention import ReapReport

__all__ = [
    "event_rows",
    "fmt_age",
    "fmt_amount",
    "fmt_gap",
    "fmt_next_check",
    "fmt_time",
    "operation_row",
    "print_json",
    "printable",
    "show_operation",
    "show_page",
    "show_reap",
    "show_stats",
    "unreadable_line",
]

# ISO 4217 minor units where they are not 2 (the amount is stored in minor units).
_ZERO = ("BIF", "CLP", "DJF", "GNF", "ISK", "JPY", "KMF", "KRW", "PYG", "RWF", "UGX", "UYI")
_EXPONENT = {
    **dict.fromkeys((*_ZERO, "VND", "VUV", "XAF", "XOF", "XPF"), 0),
    **dict.fromkeys(("BHD", "IQD", "JOD", "KWD", "LYD", "OMR", "TND"), 3),
    **dict.fromkeys(("CLF", "UYW"), 4),
}
_EVIDENCE_CHARS = 400  # per value in the timeline; --json has everything


def print_json(value: Any) -> None:
    # Plain stdout, not rich: JSON must not be wrapped, highlighted or re-indented.
    text = json.dumps(value, indent=2, ensure_ascii=False)
    try:
        text.encode(sys.stdout.encoding or "utf-8")
    except UnicodeEncodeError:
        # A stored string stdout cannot carry (a lone surrogate; a non-UTF-8 locale): JSON's
        # own \u escapes keep every value exact and the document printable.
        text = json.dumps(value, indent=2, ensure_ascii=True)
    sys.stdout.write(text + "\n")


def printable(text: str) -> str:
    """``text``, with what UTF-8 cannot encode (lone surrogates) escaped as ``\\udc80``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def unreadable_line(exc: CorruptRecord) -> str:
    """One stderr line naming a row that could not be read (and was left out)."""
    line = (
        f"warning: skipped unreadable operation {exc.operation_id} "
        f"(tenant {exc.tenant_id}): {exc.problem}"
    )
    return printable(" ".join(line.split()))


def fmt_amount(amount: int | None, currency: str | None) -> str:
    if amount is None:
        return "-"
    if currency is None:
        return str(amount)
    exponent = _EXPONENT.get(currency.upper(), 2)
    sign = "-" if amount < 0 else ""
    units, minor = divmod(abs(amount), 10**exponent)
    figure = f"{units:,}" + (f".{minor:0{exponent}d}" if exponent else "")
    return f"{sign}{figure} {currency.upper()}"


def fmt_age(delta: timedelta | None) -> str:
    """``42s``, ``15m``, ``3h12m``, ``2d4h``: coarse on purpose, two units at most."""
    if delta is None:
        return "-"
    seconds = int(delta.total_seconds())
    if seconds < 0:
        return f"-{fmt_age(-delta)}"
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours}h" if hours else f"{days}d"
    if hours:
        return f"{hours}h{minutes}m" if minutes else f"{hours}h"
    if minutes:
        return f"{minutes}m{secs}s" if secs else f"{minutes}m"
    return f"{secs}s"


def fmt_gap(delta: timedelta) -> str:
    """Time between two events: milliseconds matter for an attempt, minutes for a check."""
    seconds = delta.total_seconds()
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    return fmt_age(delta)


def fmt_time(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def fmt_next_check(record: OperationRecord, now: datetime) -> str:
    if record.terminal or record.next_check_at is None:
        return "-"
    wait = record.next_check_at - now
    if wait <= timedelta(0):
        return f"due {fmt_age(-wait)} ago" if wait < timedelta(seconds=-1) else "due"
    return f"in {fmt_age(wait)}"


def operation_row(record: OperationRecord, now: datetime) -> dict[str, str]:
    """The cells of one listing row, by column name."""
    cells = {
        "!": "!" if record.needs_attention else "",
        "id": record.id,
        "tenant": record.tenant_id,
        "operation": record.operation,
        "state": record.state.value,
        "age": fmt_age(now - record.created_at),
        "amount": fmt_amount(record.amount, record.currency),
        "provider": record.provider,
        "provider ref": record.provider_reference or "-",
        "checks": str(record.checks),
        "next check": fmt_next_check(record, now),
    }
    return {name: printable(value) for name, value in cells.items()}


def show_page(console: Console, page: Page) -> None:
    if not page.items:
        console.print("no readable operations match" if page.unreadable else "no operations match")
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in operation_row(page.items[0], page.now):
        table.add_column(name, no_wrap=True)
    for record in page.items:
        style = "red" if record.needs_attention else None
        table.add_row(*(Text(v) for v in operation_row(record, page.now).values()), style=style)
    print_wide(console, table)
    if page.has_more:
        console.print(f"more: add --after {page.next_cursor}", highlight=False, markup=False)


def _short(value: Any) -> str:
    """One evidence value as text: JSON for structures, cut at a readable length."""
    if isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)
    if len(text) > _EVIDENCE_CHARS:
        return text[:_EVIDENCE_CHARS] + f"... ({len(text)} chars; --json has all)"
    return text


def event_rows(timeline: Sequence[EventRecord]) -> list[dict[str, str]]:
    """Timeline cells: when, time since the previous event, what, who, the evidence."""
    rows = []
    previous: datetime | None = None
    for event in timeline:
        detail = dict(event.detail or {})
        took = detail.pop("duration_ms", None)
        moved = (
            f"{event.from_state or '-'} -> {event.to_state}" if event.to_state is not None else ""
        )
        evidence = ", ".join(f"{k}={_short(v)}" for k, v in detail.items() if v is not None)
        cells = {
            "time": fmt_time(event.created_at),
            "after": fmt_gap(event.created_at - previous) if previous else "",
            "kind": event.kind,
            "actor": event.actor,
            "state": moved,
            "took": f"{took} ms" if took is not None else "",
            "evidence": evidence,
        }
        rows.append({name: printable(value) for name, value in cells.items()})
        previous = event.created_at
    return rows


def show_operation(
    console: Console, record: OperationRecord, timeline: Sequence[EventRecord], now: datetime
) -> None:
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column(overflow="fold")
    lease = "-"
    if record.lease_owner is not None and record.lease_expires_at is not None:
        left = record.lease_expires_at - now
        lease = f"{record.lease_owner}, " + (
            f"expires in {fmt_age(left)}"
            if left > timedelta(0)
            else f"expired {fmt_age(-left)} ago"
        )
    for name, value in (
        ("operation", f"{record.id}  ({record.operation})"),
        ("namespace", f"tenant={record.tenant_id} key={record.idempotency_key}"),
        ("state", record.state.value + ("  NEEDS ATTENTION" if record.needs_attention else "")),
        ("amount", fmt_amount(record.amount, record.currency)),
        ("provider", f"{record.provider}  ref={record.provider_reference or '-'}"),
        ("downstream key", record.downstream_key),
        ("fingerprint", record.fingerprint),
        ("created", f"{fmt_time(record.created_at)}  ({fmt_age(now - record.created_at)} ago)"),
        ("completed", fmt_time(record.completed_at)),
        (
            "attempts",
            f"{record.attempts} (possibly sent: {'yes' if record.possibly_sent else 'no'})",
        ),
        ("checks", str(record.checks)),
        ("next check", fmt_next_check(record, now)),
        ("lease", lease),
        ("resolution", record.resolution or "-"),
        ("error code", record.error_code or "-"),
        ("retained until", fmt_time(record.retain_until)),
        ("reaped", fmt_time(record.reaped_at) if record.reaped_at else "no"),
        ("version", str(record.version)),
    ):
        facts.add_row(Text(name), Text(printable(value)))
    console.print(facts)
    console.print()
    if record.route is not None:
        show_attempts(console, record, timeline)
    table = Table(title="timeline", box=None, header_style="bold", title_justify="left")
    for name in ("time", "after", "kind", "actor", "state", "took", "evidence"):
        evidence = name == "evidence"
        table.add_column(
            name, no_wrap=not evidence, overflow="fold", min_width=60 if evidence else None
        )
    for row in event_rows(timeline):
        table.add_row(*(Text(v) for v in row.values()))
    print_wide(console, table)


def attempt_rows(record: OperationRecord, timeline: Sequence[EventRecord]) -> list[dict[str, str]]:
    """A routed operation's attempts, one per provider it was sent to, with what each
    came to: the proof it moved on with, the current one's state, and any effect a later
    look found there (a cross-provider duplicate)."""
    from ..reconciling._crossings import CROSS_DUPLICATE, CROSS_LEFT, CROSS_REVERSAL
    from ..routing import attempts_of

    found: dict[tuple[str, str], str] = {}
    for event in timeline:
        detail = event.detail or {}
        if event.kind == CROSS_DUPLICATE:
            for effect in detail.get("effects") or ():
                if isinstance(effect, dict) and not effect.get("answered"):
                    where = (str(effect.get("provider")), str(effect.get("downstream_key")))
                    found[where] = f"LATE EFFECT {effect.get('provider_reference')} (flagged)"
        elif event.kind in (CROSS_REVERSAL, CROSS_LEFT):
            for where, text in list(found.items()):
                if where[0] == detail.get("provider"):
                    how = detail.get("how")
                    done = f"reversed by {how}" if how else "left to the operator"
                    if detail.get("refund_operation_id"):
                        done += f" (operation {detail['refund_operation_id']})"
                    found[where] = f"{text}; {done}"
    steps = attempts_of(record.route)
    rows = []
    for number, step in enumerate(steps, 1):
        key = str(step.get("downstream_key") or "")
        current = number == len(steps)
        came_to = f"moved on: {step.get('proof')}" if step.get("proof") else "-"
        if current:
            reference = record.provider_reference or "-"
            came_to = f"{record.state.value} ref={reference}"
        extra = found.get((step["provider"], key))
        rows.append(
            {
                "#": str(number),
                "provider": step["provider"],
                "downstream key": key,
                "code": str(step.get("code") or "-"),
                "came to": came_to + (f"; {extra}" if extra else ""),
            }
        )
    return rows


def show_attempts(
    console: Console, record: OperationRecord, timeline: Sequence[EventRecord]
) -> None:
    route = record.route or {}
    order = " > ".join(str(p) for p in route.get("providers") or ())
    skipped = route.get("skipped") or []
    title = f"route {route.get('rule', '-')}: {order}"
    if skipped:
        title += f" (passed over as unhealthy: {', '.join(map(str, skipped))})"
    table = Table(title=title, box=None, header_style="bold", title_justify="left")
    rows = attempt_rows(record, timeline)
    for name in rows[0] if rows else ():
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*(Text(printable(v)) for v in row.values()))
    print_wide(console, table)
    console.print()


def show_stats(console: Console, stats: Stats) -> None:
    scope = f" for tenant {stats.tenant_id}" if stats.tenant_id else ""
    console.print(Text(f"{stats.total} operations{scope} at {fmt_time(stats.now)}"))
    states = Table(box=None, header_style="bold")
    states.add_column("state")
    states.add_column("count", justify="right")
    for state, count in stats.by_state.items():
        states.add_row(Text(printable(state)), str(count))
    console.print(states)
    oldest = stats.oldest_unknown_created_at
    console.print(
        Text(
            f"oldest outcome_unknown: {fmt_time(oldest)} ({fmt_age(stats.oldest_unknown_age)} old)"
            if oldest
            else "oldest outcome_unknown: none"
        )
    )
    console.print(Text(f"needs attention: {stats.needs_attention}"))
    window = fmt_age(stats.window)
    console.print(
        Text(
            f"last {window}: {stats.replayed_operations} operations replayed, "
            f"{stats.conflicts} fingerprint conflicts (key reused with other effect fields)"
        )
    )
    console.print(Text(f"replays in all: {stats.replays} (duplicates answered from storage)"))
    providers = Table(box=None, header_style="bold")
    providers.add_column("provider")
    for state in stats.by_state:
        providers.add_column(printable(state), justify="right")
    for provider, counts in sorted(stats.by_provider.items()):
        providers.add_row(
            Text(printable(provider)), *(str(counts.get(s, 0)) for s in stats.by_state)
        )
    console.print(providers)


def show_reap(console: Console, report: ReapReport) -> None:
    if report.items:
        table = Table(box=None, header_style="bold")
        for name in ("tenant", "operation", "key", "state", "retained until", "operation id"):
            table.add_column(name, overflow="fold")
        for item in report.items:
            table.add_row(
                *(
                    Text(v)
                    for v in (
                        item.tenant_id,
                        item.operation,
                        item.idempotency_key,
                        item.state,
                        fmt_time(item.retain_until),
                        item.operation_id,
                    )
                )
            )
        console.print(table)
    if report.dry_run:
        console.print(f"dry run: {len(report.items)} namespaces would become tombstones")
    else:
        skipped = f" ({report.skipped} changed meanwhile, skipped)" if report.skipped else ""
        console.print(f"reaped {report.reaped} namespaces{skipped}")


def print_wide(console: Console, table: Table) -> None:
    """Print a table at its natural width, even past a narrow terminal's edge.

    Squeezed into 80 columns, ids and amounts shrink to nothing; a long line the terminal
    wraps is still readable, and piped output is never cut.
    """
    needed = Measurement.get(console, console.options.update_width(10_000), table).maximum
    if needed <= console.width:
        console.print(table)
        return
    saved = console.width
    console.width = needed
    try:
        console.print(table)
    finally:
        console.width = saved
