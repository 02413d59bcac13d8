"""``payorch sandbox``: the loopback acquirer, for the demo and for trying things out.

``serve`` exposes everything the sandbox server can do (docs/sandbox.md): fault rates and
one-shot faults, base latency, status lag, settling and webhook delays, webhook targets and
their signing secret. A bad value is a one-line usage error (exit 2) before anything listens,
a duration beyond what its flag takes too (the server's bounds, ``MAX_*`` in its module).
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Annotated

import typer

from ..errors import ConfigurationError
from ._runtime import parse_duration, settings

__all__ = ["sandbox_app"]

sandbox_app = typer.Typer(help="The sandbox acquirer (loopback only).", no_args_is_help=True)

# ASCII digits only: \d takes other scripts' digits, and str.isdigit() superscripts too.
_MILLIS = re.compile(r"([0-9]+(?:\.[0-9]+)?)ms")
_COUNT = re.compile(r"[0-9]+")
MAX_FAULT_TIMES = 10_000  # one-shot faults one --fault-next may queue
SECRET_ENV = "PAYORCH_SANDBOX_WEBHOOK_SECRET"  # noqa: S105 - the variable's name


def _duration(text: str) -> float:
    """Seconds of a duration as the other commands take it (30s, 15m, 2h, 1h30m), or in ms
    (250ms); not bounded here (see _seconds)."""
    value = text.strip().lower()
    millis = _MILLIS.fullmatch(value)
    if millis is not None:
        return float(millis.group(1)) / 1000  # inf for an absurd number: refused by the caller
    if value == "0":
        return 0.0
    return parse_duration(text).total_seconds()


def _fault_names() -> str:
    from ..providers.sandbox._faults import ALIASES, Fault

    return ", ".join([*(f.value for f in Fault), *ALIASES])


def _fault_rates(values: list[str]) -> dict[str, float]:
    """``KIND=RATE`` flags as the server takes them; BadParameter names the bad one."""
    from ..providers.sandbox._faults import parse_fault

    rates: dict[str, float] = {}
    for value in values:
        name, sep, number = value.partition("=")
        if not sep:
            raise typer.BadParameter(f"{value!r} is not KIND=RATE, e.g. timeout=0.1")
        try:
            fault = parse_fault(name)
        except ValueError:
            raise typer.BadParameter(
                f"unknown fault {name.strip()!r}; known: {_fault_names()}"
            ) from None
        try:
            rate = float(number)
        except ValueError:
            rate = math.nan
        if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
            raise typer.BadParameter(f"rate of {fault.value} must be within 0..1, not {number!r}")
        if fault.value in rates:
            raise typer.BadParameter(f"{fault.value} is given twice")
        rates[fault.value] = rate
    if sum(rates.values()) > 1.0 + 1e-9:
        raise typer.BadParameter("the rates add up to more than 1")
    return rates


def _fault_queue(values: list[str]) -> list[tuple[str, int]]:
    """``KIND[:N]`` flags, in the order given: the next N POSTs get KIND."""
    from ..providers.sandbox._faults import parse_fault

    queue: list[tuple[str, int]] = []
    for value in values:
        name, sep, count = value.partition(":")
        try:
            fault = parse_fault(name)
        except ValueError:
            raise typer.BadParameter(
                f"unknown fault {name.strip()!r}; known: {_fault_names()}"
            ) from None
        count = count.strip()
        if not sep:
            times = 1
        elif _COUNT.fullmatch(count) and len(count) <= len(str(MAX_FAULT_TIMES)):
            times = int(count)  # the length bound keeps int() within its digit limit
        else:
            times = -1
        if not 1 <= times <= MAX_FAULT_TIMES:
            raise typer.BadParameter(
                f"{value!r}: N must be a whole number from 1 to {MAX_FAULT_TIMES}"
            )
        queue.append((fault.value, times))
    return queue


def _limits() -> dict[str, float]:
    """The longest DURATION each flag takes, in seconds: the server's own bounds."""
    from ..providers.sandbox._server import MAX_REQUEST_WAIT, MAX_SPAN, MAX_WEBHOOK_DELAY

    return {
        "--latency": MAX_REQUEST_WAIT,
        "--jitter": MAX_REQUEST_WAIT,
        "--status-lag": MAX_SPAN,
        "--settle-after": MAX_SPAN,
        "--idempotency-window": MAX_SPAN,
        "--drop-hold": MAX_REQUEST_WAIT,
        "--trickle-interval": MAX_REQUEST_WAIT,
        "--webhook-delay": MAX_WEBHOOK_DELAY,
    }


def _limit_text(seconds: float) -> str:
    for unit, size in (("100 years", 100 * 365 * 86400.0), ("1d", 86400.0), ("1h", 3600.0)):
        if seconds == size:
            return unit
    return f"{seconds:g}s"


def _seconds(value: str, flag: str, limit: float) -> float:
    try:
        seconds = _duration(value)
    except typer.BadParameter as exc:
        raise typer.BadParameter(exc.message, param_hint=flag) from None
    except (OverflowError, ValueError):  # a number too large for the arithmetic
        seconds = math.inf
    if not seconds <= limit:
        raise typer.BadParameter(
            f"{value!r} is too long: at most {_limit_text(limit)}", param_hint=flag
        )
    return seconds


def _span(help_text: str) -> typer.models.OptionInfo:
    """An option that takes a DURATION (250ms, 2s, 15m, 24h); the command parses it."""
    info: typer.models.OptionInfo = typer.Option(metavar="DURATION", help=help_text)
    return info


def _hint(message: str) -> str:
    """The flag a server's ValueError is about."""
    if "secret" in message:
        return "--webhook-secret"
    return "--webhook-url" if "webhook" in message else "--host"


@sandbox_app.command("serve")
def serve_cmd(
    *,
    port: Annotated[int, typer.Option(min=0, max=65535, help="0 picks a free port.")] = 8765,
    host: Annotated[str, typer.Option(help="A loopback address.")] = "127.0.0.1",
    seed: Annotated[
        int, typer.Option(help="Seed for the fault-rate draws and the jitter (reproducible).")
    ] = 0,
    fault_rate: Annotated[
        list[str] | None,
        typer.Option(
            "--fault-rate",
            metavar="KIND=RATE",
            help="Give this share (0..1) of payment POSTs the fault KIND; repeat per kind "
            "(the rates add up to at most 1). KIND: latency, decline, error_500_before, "
            "error_500_after, drop_after (alias timeout), reset_after, rate_limit, pending, "
            "trickle.",
            show_default=False,
        ),
    ] = None,
    fault_next: Annotated[
        list[str] | None,
        typer.Option(
            "--fault-next",
            metavar="KIND[:N]",
            help="Give the next N (default 1) payment POSTs the fault KIND, before any rate "
            "applies; repeat to queue more, in order.",
            show_default=False,
        ),
    ] = None,
    latency: Annotated[
        str,
        _span("Delay every API request this long before handling it (e.g. 250ms, 2s; at most 1h)."),
    ] = "0",
    jitter: Annotated[
        str,
        _span("Add a seeded random delay of up to this much to every API request (at most 1h)."),
    ] = "0",
    status_lag: Annotated[
        str,
        _span("Status queries and listings see an effect only this long after it was made."),
    ] = "0",
    settle_after: Annotated[
        str,
        _span("A 'pending' effect succeeds this long after it was made."),
    ] = "10s",
    idempotency_window: Annotated[
        str,
        _span("How long an Idempotency-Key replays its first answer."),
    ] = "24h",
    retry_after: Annotated[
        int,
        typer.Option(min=0, max=86400, help="Retry-After seconds of 429 and 409 answers."),
    ] = 1,
    drop_hold: Annotated[
        str,
        _span(
            "How long drop_after holds the connection before closing it unanswered (at most 1h)."
        ),
    ] = "30s",
    trickle_interval: Annotated[
        str,
        _span("The pause between two bytes of a trickled answer (at most 1h)."),
    ] = "50ms",
    webhook_url: Annotated[
        list[str] | None,
        typer.Option(
            "--webhook-url",
            metavar="URL",
            help="Post every signed event to this loopback URL; {tenant} in it is the "
            "effect's tenant, e.g. http://127.0.0.1:8000/webhooks/{tenant}/sandbox. "
            "Repeat for more targets.",
            show_default=False,
        ),
    ] = None,
    webhook_delay: Annotated[
        str,
        _span(
            "Post each event this long after it happened (a notification lags the answer; "
            "at most 1d)."
        ),
    ] = "0",
    webhook_secret: Annotated[
        str | None,
        typer.Option(
            "--webhook-secret",
            metavar="SECRET",
            help="Signing secret (base64, optionally whsec_); default "
            "PAYORCH_SANDBOX_WEBHOOK_SECRET, else a new one, printed at start.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve the sandbox acquirer until Ctrl-C or SIGTERM; prints what it listens on, its
    webhook secret and the faults in force (docs/sandbox.md)."""
    from ..providers.sandbox import SandboxServer, serve

    try:
        rates = _fault_rates(fault_rate or [])
    except typer.BadParameter as exc:
        raise typer.BadParameter(exc.message, param_hint="--fault-rate") from None
    try:
        queue = _fault_queue(fault_next or [])
    except typer.BadParameter as exc:
        raise typer.BadParameter(exc.message, param_hint="--fault-next") from None
    given = {
        "--latency": latency,
        "--jitter": jitter,
        "--status-lag": status_lag,
        "--settle-after": settle_after,
        "--idempotency-window": idempotency_window,
        "--drop-hold": drop_hold,
        "--trickle-interval": trickle_interval,
        "--webhook-delay": webhook_delay,
    }
    spans = {flag: _seconds(given[flag], flag, limit) for flag, limit in _limits().items()}
    secret = webhook_secret if webhook_secret is not None else settings().sandbox_webhook_secret
    # Where a bad secret came from, for the one-line error.
    secret_source = "--webhook-secret" if webhook_secret is not None else SECRET_ENV

    def ready(sandbox: SandboxServer) -> None:
        # Queued before the banner: whoever waits for the URL finds the faults in place.
        for fault, times in queue:
            sandbox.inject(fault, times)
        typer.echo("\n".join(sandbox.describe()))  # stdout, flushed by echo

    try:
        serve(
            host,
            port,
            on_ready=ready,
            seed=seed,
            webhook_secret=secret,
            webhook_url=webhook_url or None,
            webhook_delay=spans["--webhook-delay"],
            fault_rates=rates,
            latency=spans["--latency"],
            jitter=spans["--jitter"],
            status_lag=timedelta(seconds=spans["--status-lag"]),
            settle_after=timedelta(seconds=spans["--settle-after"]),
            idempotency_window=timedelta(seconds=spans["--idempotency-window"]),
            retry_after=str(retry_after),
            drop_hold_seconds=spans["--drop-hold"],
            trickle_interval=spans["--trickle-interval"],
        )
    except ValueError as exc:  # a host or webhook URL that is not loopback, a bad secret
        hint = _hint(str(exc))
        raise typer.BadParameter(
            str(exc), param_hint=secret_source if hint == "--webhook-secret" else hint
        ) from None
    except OSError as exc:  # e.g. the port is in use
        raise ConfigurationError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
