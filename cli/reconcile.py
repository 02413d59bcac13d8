"""``payorch reconcile``: settle unknown and abandoned operations from evidence."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from . import render
from .runtime import DatabaseUrl, JsonFlag, err, open_store, out, reconciler, settings

if TYPE_CHECKING:
    from payorch.reconciler import ReconcileReport

__all__ = ["reconcile_app"]

reconcile_app = typer.Typer(
    help="The reconciler: drive unknown operations to the truth.", no_args_is_help=True
)

Batch = Annotated[
    int | None,
    typer.Option(
        min=1, max=1000, help="Operations per pass (default PAYORCH_RECONCILE_BATCH_SIZE)."
    ),
]


def _summary(report: ReconcileReport) -> str:
    outcomes = ", ".join(f"{k}={v}" for k, v in sorted(report.outcomes.items())) or "nothing due"
    released = f", {report.released} released" if report.released else ""
    return f"picked {report.picked}: {outcomes}{released}"


@reconcile_app.command("once")
def once_cmd(
    *, batch: Batch = None, database_url: DatabaseUrl = None, json_: JsonFlag = False
) -> None:
    """Run one pass: lease a batch of due operations, query providers, apply evidence."""
    config = settings()
    with open_store(database_url) as store, reconciler(store, config, batch=batch) as rec:
        report = rec.reconcile_once()
    if json_:
        render.print_json(
            {
                "picked": report.picked,
                "outcomes": dict(report.outcomes),
                "released": report.released,
            }
        )
    else:
        out().print(Text(_summary(report)))


@reconcile_app.command("run")
def run_cmd(
    *,
    interval: Annotated[
        float | None,
        typer.Option(
            min=0.1, help="Seconds between passes (default PAYORCH_RECONCILE_INTERVAL_SECONDS)."
        ),
    ] = None,
    batch: Batch = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Run the reconciler until SIGTERM/SIGINT; the pass in flight finishes first."""
    from payorch.daemon import ReconcilerDaemon

    config = settings()
    seconds = interval or config.reconcile_interval_seconds
    # A pass longer than the interval is skipped by design (no overlapping passes); that
    # is not worth a warning line every interval.
    logging.getLogger("apscheduler.scheduler").setLevel(logging.ERROR)
    logging.getLogger("apscheduler.executors").setLevel(logging.ERROR)
    console = err()  # progress goes to stderr: stdout stays free for the final summary

    def on_report(report: ReconcileReport) -> None:
        if report.picked:
            console.print(Text(_summary(report)))

    with open_store(database_url) as store, reconciler(store, config, batch=batch) as rec:
        console.print(
            Text(f"reconciler {rec.owner}: a pass every {seconds:g}s, Ctrl-C or SIGTERM to stop")
        )
        daemon = ReconcilerDaemon(rec, interval=timedelta(seconds=seconds), on_report=on_report)
        total = daemon.run()
    out().print(Text(f"stopped after {daemon.passes} passes; {_summary(total)}"))
