"""``payorch stats``: the state of the operations at a glance."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

import typer
from rich.text import Text

from . import _render as render
from ._runtime import DatabaseUrl, JsonFlag, duration_option, open_store, out

__all__ = ["stats_cmd"]

DEFAULT_WINDOW = timedelta(hours=24)


def stats_cmd(
    *,
    window: Annotated[
        timedelta | None,
        duration_option(
            "Count replayed operations and fingerprint conflicts over this window.",
            default="24h",
        ),
    ] = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant.")] = None,
    database_url: DatabaseUrl = None,
    json_: JsonFlag = False,
) -> None:
    """Operations by state and provider, the oldest unknown, attention, replays, conflicts;
    the outbox's backlog and dead letters."""
    window = window if window is not None else DEFAULT_WINDOW
    if window <= timedelta(0):
        raise typer.BadParameter("the window must be positive", param_hint="'--window'")
    with open_store(database_url) as store:
        from ..outbox import stats as outbox_stats
        from ..storage._queries import stats

        result = stats(store, window=window, tenant_id=tenant)
        outbox = outbox_stats(store, tenant_id=tenant)
    if json_:
        render.print_json({**result.to_dict(), "outbox": dict(outbox)})
    else:
        render.show_stats(out(), result)
        out().print(
            Text(
                f"outbox: {outbox['pending']} pending ({outbox['due']} due, oldest "
                f"{outbox['oldest_pending_seconds']:.0f}s), {outbox['dead']} dead, "
                f"{outbox['delivered']} delivered"
            )
        )
