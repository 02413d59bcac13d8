"""``payorch db health``: the database's role, how it is replicated, and how payorch's
tables are placed (one node, or distributed by tenant on Citus)."""

from __future__ import annotations

from rich.text import Text

from . import _render as render
from ._runtime import DatabaseUrl, JsonFlag, open_store, out

__all__ = ["health_cmd"]


def health_cmd(database_url: DatabaseUrl = None, json_: JsonFlag = False) -> None:
    """The replication mode (sync, sync_blocked, async, none, unknown; local for SQLite)
    and the tables' placement (single node, or Citus: distributed by tenant, shards, nodes).

    Exit 1, one line on stderr, for a standby or a read-only session, an unreachable
    database, PAYORCH_REQUIRE_SYNC_STANDBY set while no synchronous standby streams, or
    tables placed in a way payorch cannot serve (partly distributed).
    """
    from ..errors import ConfigurationError
    from ..storage._distribution import layout_problem, read_placement
    from ..storage._replication import ENV_STRICT, strict_from_env

    strict = strict_from_env()
    # Built lenient: the strict refusal is reported below, with the status it rests on.
    with open_store(database_url, require_sync_standby=False) as store:
        status = store.replication.status()
        placement = read_placement(store.engine)
    problem = status.refusal() if strict else None
    layout = layout_problem(placement)
    if json_:
        render.print_json(
            {
                **status.to_dict(),
                "strict": strict,
                "problem": problem or layout,
                "placement": placement.as_dict(),
            }
        )
    else:
        out().print(Text(f"replication {status.describe()}"))
        out().print(Text(f"{ENV_STRICT} {'on' if strict else 'off'}"))
        out().print(Text(f"placement {placement.describe()}"))
    if layout is not None:
        raise ConfigurationError(layout)
    if problem is not None:
        raise ConfigurationError(
            f"{ENV_STRICT} is set (claims need a synchronous standby), but {problem}"
        )
