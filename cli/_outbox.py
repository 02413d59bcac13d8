"""``payorch outbox``: the messages staged after the payment, what was delivered, what died."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from . import _render as render
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
    relay,
    settings,
)

if TYPE_CHECKING:
    from ..outbox import RelayReport, StoredMessage

__all__ = ["outbox_app"]

outbox_app = typer.Typer(
    help="The outbox: messages staged with outcomes, delivered at least once.",
    no_args_is_help=True,
)

MessageId = Annotated[str, typer.Argument(help="Message id.", show_default=False)]
Limit = Annotated[int, typer.Option(min=1, max=1000, help="How many, newest first.")]
STATES = ("pending", "delivered", "dead")


def _state(value: str | None) -> str | None:
    if value is not None and value not in STATES:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(STATES)}")
    return value


def _table(found: list[StoredMessage]) -> None:
    table = Table(box=None, pad_edge=False)
    for name in ("id", "tenant", "type", "aggregate", "destination", "state", "tries", "error"):
        table.add_column(name)
    for m in found:
        table.add_row(
            *(
                Text(render.printable(value))
                for value in (
                    m.id,
                    m.tenant_id,
                    m.type,
                    f"{m.aggregate_type}/{m.aggregate_id}",
                    m.destination,
                    m.state,
                    str(m.attempts),
                    (m.last_error or "")[:80],
                )
            )
        )
    render.print_wide(out(), table)


def _listing(
    database_url: str | None, state: str | None, tenant: str | None, limit: int, json_: bool
) -> None:
    from ..outbox import messages

    with open_store(database_url) as store:
        found = messages(store, state=state, tenant_id=tenant, limit=limit)
    if json_:
        render.print_json([m.as_json() for m in found])
    elif not found:
        out().print("no messages")
    else:
        _table(found)


@outbox_app.command("list")
def list_cmd(
    *,
    state: Annotated[
        str | None,
        typer.Option(callback=_state, help="Only this state: pending, delivered or dead."),
    ] = None,
    tenant: Tenant = None,
    limit: Limit = 50,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """List outbox messages, newest first."""
    _listing(database_url, state, tenant, limit, json_)


@outbox_app.command("dead")
def dead_cmd(
    *,
    tenant: Tenant = None,
    limit: Limit = 50,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """List the dead letters: messages no sink took after the relay's last attempt."""
    _listing(database_url, "dead", tenant, limit, json_)


@outbox_app.command("show")
def show_cmd(
    *,
    message_id: MessageId,
    tenant: Tenant = None,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """One message: where it goes, its attempts, its last error and its payload."""
    from ..outbox import find

    with open_store(database_url) as store:
        found = find(store, message_id, tenant_id=tenant)
    if json_:
        render.print_json(found.as_json())
        return
    console = out()
    for name, value in found.as_json().items():
        console.print(Text(f"{name}: {render.printable(str(value))}"))


@outbox_app.command("retry")
def retry_cmd(
    *,
    message_id: MessageId,
    reason: Annotated[
        str,
        typer.Option(callback=not_blank, help="Why (kept in the audit event).", show_default=False),
    ],
    actor: Annotated[
        str | None,
        typer.Option(callback=not_blank, help="Who asks (default: the login name)."),
    ] = None,
    tenant: Tenant = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Deliver a dead (or backing-off) message again now, with a fresh count of attempts."""
    from ..outbox import retry

    with open_store(database_url) as store:
        after = retry(
            store, message_id, actor=actor or default_actor(), reason=reason, tenant_id=tenant
        )
    out().print(Text(f"message {after.id} is pending again (due now)"))


@outbox_app.command("purge")
def purge_cmd(
    *,
    older_than: Annotated[
        timedelta,
        duration_option("Delete messages delivered at least this long ago: 7d, 12h."),
    ],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Count what would be deleted; delete nothing.")
    ] = False,
    database_url: DatabaseUrl = None,
) -> None:
    """Delete delivered messages past an age (pending and dead ones are always kept)."""
    from ..outbox import purge

    with open_store(database_url) as store:
        count = purge(store, older_than=older_than, dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    out().print(f"{verb} {count} delivered messages")


def _summary(report: RelayReport) -> str:
    return (
        f"leased {report.leased}: delivered {report.delivered}, failed {report.failed}, "
        f"dead {report.dead}, lost {report.lost}, released {report.released}"
    )


@outbox_app.command("relay")
def relay_cmd(
    *,
    once: Annotated[bool, typer.Option("--once", help="Drain what is due now, then exit.")] = False,
    interval: Annotated[
        float | None,
        typer.Option(
            min=0.1, help="Seconds between passes (default PAYORCH_OUTBOX_INTERVAL_SECONDS)."
        ),
    ] = None,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """Deliver the outbox to the sinks of PAYORCH_OUTBOX_SINKS, until SIGTERM/SIGINT.

    `payorch reconcile run` relays too when the sinks are set; this runs a relay alone."""
    import signal

    from ..observing import _logs as logs

    logs.command_default(logging.INFO)
    config = settings()
    seconds = interval or config.outbox_interval_seconds
    with open_store(database_url) as store, relay(store, config, required=True) as relaying:
        assert relaying is not None
        if once:
            report = relaying.drain()
            if json_:
                render.print_json(
                    {
                        "leased": report.leased,
                        "delivered": report.delivered,
                        "failed": report.failed,
                        "dead": report.dead,
                        "lost": report.lost,
                    }
                )
            else:
                out().print(Text(_summary(report)))
            return
        from ..errors import StorageError

        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        err().print(Text(f"relaying every {timedelta(seconds=seconds).total_seconds():g}s"))
        log = logging.getLogger("payorch.outbox")
        while not stop.is_set():
            try:
                report = relaying.drain(stop=stop)
            except StorageError as exc:  # the database is away: one line, the next pass retries
                log.warning("outbox pass skipped: %s", " ".join(exc.message.split()))
            else:
                if report.leased or report.dead:
                    log.info(_summary(report))
            stop.wait(seconds)
