"""``payorch sandbox``: the loopback acquirer, for the demo and for trying things out."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import ConfigurationError
from ._runtime import settings

__all__ = ["sandbox_app"]

sandbox_app = typer.Typer(help="The sandbox acquirer (loopback only).", no_args_is_help=True)


@sandbox_app.command("serve")
def serve_cmd(
    *,
    port: Annotated[int, typer.Option(min=0, max=65535, help="0 picks a free port.")] = 8765,
    host: Annotated[str, typer.Option(help="A loopback address.")] = "127.0.0.1",
    seed: Annotated[int, typer.Option(help="Seed for random faults.")] = 0,
) -> None:
    """Serve the sandbox acquirer until Ctrl-C or SIGTERM (webhook secret printed at start)."""
    from ..providers.sandbox import serve

    try:
        serve(host, port, seed=seed, webhook_secret=settings().sandbox_webhook_secret)
    except ValueError as exc:  # e.g. a host that is not loopback
        raise typer.BadParameter(str(exc)) from None
    except OSError as exc:  # e.g. the port is in use
        raise ConfigurationError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
