"""``payorch reconcile``: settle unknown and abandoned operations from evidence."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from . import _render as render
from ._runtime import DatabaseUrl, JsonFlag, err, open_store, out, reconciler, relay, settings

if TYPE_CHECKING:
    from ..reconciling._fallback_watch import FallbackWatch
    from ..reconciling._reconciler import Reconciler, ReconcileReport
    from ..reconciling._watch import UnexplainedWatch
    from ..settings import Settings

__all__ = ["fallback_watch", "reconcile_app", "unexplained_watch"]

reconcile_app = typer.Typer(
    help="The reconciler: drive unknown operations to the truth.", no_args_is_help=True
)

Batch = Annotated[
    int | None,
    typer.Option(
        min=1, max=1000, help="Operations per pass (default PAYORCH_RECONCILE_BATCH_SIZE)."
    ),
]

Concurrency = Annotated[
    int | None,
    typer.Option(
        help="Checks run at once per pass, at most the database pool's size "
        "(default PAYORCH_RECONCILE_CONCURRENCY, else 8).",
        show_default=False,
    ),
]


_PROGRESS_STEP = 100  # checks between two progress lines of `reconcile once`


def _summary(report: ReconcileReport) -> str:
    outcomes = ", ".join(f"{k}={v}" for k, v in sorted(report.outcomes.items())) or "nothing due"
    released = f", {report.released} released" if report.released else ""
    return f"picked {report.picked}: {outcomes}{released}"


@reconcile_app.command("once")
def once_cmd(
    *,
    batch: Batch = None,
    concurrency: Concurrency = None,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """Run one pass: lease a batch of due operations, query providers, apply evidence."""
    from ..observing import _logs as logs
    from ._progress import bar, log_every

    logs.command_default(logging.INFO)
    config = settings()
    # A long batch reports as it goes: a bar on a terminal, a log line per 100 checks else.
    lines = log_every(_PROGRESS_STEP, logs.reconcile_progress)
    with open_store(database_url) as store:
        # A database never migrated (or migrated by an older payorch) is refused with the
        # command to run, before anything is leased.
        store.check_schema()
        with (
            reconciler(store, config, batch=batch, concurrency=concurrency) as rec,
            bar("reconciling", console=err()) as drawn,
        ):

            def progress(done: int, picked: int) -> None:
                drawn(done, picked)
                lines(done, picked)

            report = rec.reconcile_once(progress=progress)
    logs.reconcile_pass(report.picked, report.outcomes, report.released)
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
    concurrency: Concurrency = None,
    database_url: DatabaseUrl = None,
    metrics_addr: Annotated[
        str | None,
        typer.Option(
            "--metrics-addr",
            "--metrics",
            help="Serve /metrics, /healthz, /readyz on host:port, or 'off' "
            "(default PAYORCH_METRICS_ADDR, else 127.0.0.1:9464).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run the reconciler until SIGTERM/SIGINT; the checks in flight finish first.

    While work is due, passes follow one another; once a pass finds nothing, the next
    comes after the interval."""
    from ..observing import _logs as logs
    from ..reconciling._daemon import ReconcilerDaemon, parse_address

    logs.command_default(logging.INFO)
    config = settings()
    seconds = interval or config.reconcile_interval_seconds
    monitor = parse_address(metrics_addr if metrics_addr is not None else config.metrics_addr)
    # A pass longer than the interval is skipped by design (no overlapping passes); that
    # is not worth a warning line every interval.
    logging.getLogger("apscheduler.scheduler").setLevel(logging.ERROR)
    logging.getLogger("apscheduler.executors").setLevel(logging.ERROR)

    def on_report(report: ReconcileReport) -> None:
        if report.picked:  # a log line (time, level; --log-format)
            logs.reconcile_pass(report.picked, report.outcomes, report.released)

    with (
        open_store(database_url) as store,
        reconciler(store, config, batch=batch, concurrency=concurrency) as rec,
        relay(store, config, required=False) as relaying,  # with PAYORCH_OUTBOX_SINKS set
    ):
        watch = unexplained_watch(rec, config)  # refused, if it is, before starting
        fallbacks = fallback_watch(rec, config)
        if config.routing:  # the app's routing table: refused here as at the app's start-up
            from ..routing import load_router

            load_router(config.routing).check(rec.providers)
        daemon = ReconcilerDaemon(
            rec,
            interval=timedelta(seconds=seconds),
            on_report=on_report,
            monitor=monitor,
            unexplained=watch,
            relay=relaying,
            relay_interval=timedelta(seconds=config.outbox_interval_seconds),
            fallbacks=fallbacks,
        )

        def serving() -> None:
            # Only once the schema was checked and the monitor bound: a refused start-up
            # never says "started".
            logs.reconciler_started(rec.owner, seconds)
            if daemon.monitor is not None:
                url = daemon.monitor.url
                logs.emit(logs.reconciler_log, logging.INFO, "monitor.started", url=url)

        total = daemon.run(on_start=serving)
    out().print(Text(f"stopped after {daemon.passes} passes; {_summary(total)}"))


def fallback_watch(rec: Reconciler, config: Settings) -> FallbackWatch | None:
    """The daemon's look at the providers routed operations moved away from, every
    PAYORCH_FALLBACK_WATCH_SECONDS (0: never)."""
    if config.fallback_watch_seconds <= 0:
        return None
    from ..reconciling._fallback_watch import FallbackWatch

    every = timedelta(seconds=config.fallback_watch_seconds)
    return FallbackWatch(store=rec.store, crossings=rec.crossings, every=every)


def unexplained_watch(rec: Reconciler, config: Settings) -> UnexplainedWatch | None:
    """The daemon's look for effects no operation explains, as the settings ask (or None).

    ``PAYORCH_UNEXPLAINED_PROVIDERS`` names must be configured and able to list, or start-up
    is refused; left empty, every configured provider that can list is looked at."""
    if config.unexplained_every_seconds <= 0:
        return None
    from ..errors import UnknownProvider
    from ..operations import default_registry
    from ..provider import EffectLister
    from ..reconciling._unexplained import lister_of
    from ..reconciling._watch import UnexplainedWatch

    names = [n.strip() for n in config.unexplained_providers.split(",") if n.strip()]
    unknown = [n for n in names if n not in rec.providers]
    if unknown:
        raise UnknownProvider(
            f"PAYORCH_UNEXPLAINED_PROVIDERS names {', '.join(unknown)}, not configured here"
        )
    chosen = (
        [lister_of(rec.providers[n]) for n in names]
        if names
        else [p for p in rec.providers.values() if isinstance(p, EffectLister)]
    )
    return UnexplainedWatch(
        store=rec.store,
        providers=chosen,
        every=timedelta(seconds=config.unexplained_every_seconds),
        window=timedelta(seconds=config.unexplained_window_seconds),
        adopt=config.unexplained_adopt,
        actor=rec.owner,
        registry=default_registry(),
    )
