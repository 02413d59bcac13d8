"""``payorch db health``: the database's role and how it is replicated."""

from __future__ import annotations

from rich.text import Text

from . import _render as render
from ._runtime import DatabaseUrl, JsonFlag, open_store, out

__all__ = ["health_cmd"]


def health_cmd(database_url: DatabaseUrl = None, json_: JsonFlag = False) -> None:
    """The replication mode (sync, sync_blocked, async, none, unknown; local for SQLite).

    Exit 1, one line on stderr, for a standby or a read-only session, an unreachable
    database, or PAYORCH_REQUIRE_SYNC_STANDBY set while no synchronous standby streams.
    """
    from ..errors import ConfigurationError
    from ..storage._replication import ENV_STRICT, strict_from_env

    strict = strict_from_env()
    # Built lenient: the strict refusal is reported below, with the status it rests on.
    with open_store(database_url, require_sync_standby=False) as store:
        status = store.replication.status()
    problem = status.refusal() if strict else None
    if json_:
        render.print_json({**status.to_dict(), "strict": strict, "problem": problem})
    else:
        out().print(Text(f"replication {status.describe()}"))
        out().print(Text(f"{ENV_STRICT} {'on' if strict else 'off'}"))
    if problem is not None:
        raise ConfigurationError(
            f"{ENV_STRICT} is set (claims need a synchronous standby), but {problem}"
        )
