"""payorch on Citus: how its tables are placed, and ``payorch db distribute``.

Every payorch table holds ``tenant_id`` in its keys; on a Citus cluster they are
distributed by it and co-located with ``payorch_operations``, so one tenant's operation, its
events, webhook deliveries, outbox messages, effects and left route keys live on one shard
and every single-tenant statement is a router query. The version table (no tenant) is a reference
table: a copy on every node. The outbox's staging sequence stays on the coordinator, where
payorch connects.

A store reads the placement once (:func:`read_placement`): the work queues pick
differently on a distributed schema (a read that locks nothing across shards, then leases
within one tenant). A layout payorch cannot serve (some tables distributed and others not,
distributed by another column, not co-located) is refused with the reason
(:func:`layout_problem`) when a process checks its schema at start-up.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..errors import ConfigurationError
from . import _sessions as sessions
from ._engine import read_in_transaction, run_in_transaction
from ._tables import effects, events, operations, outbox, route_keys, webhook_inbox

__all__ = [
    "DISTRIBUTED_TABLES",
    "DISTRIBUTE_HINT",
    "DISTRIBUTION_COLUMN",
    "Placed",
    "Placement",
    "distribute",
    "distributed_if_known",
    "is_distributed",
    "layout_problem",
    "read_placement",
]

DISTRIBUTION_COLUMN = "tenant_id"
# Co-located with the first: a tenant's rows of every table on one shard.
DISTRIBUTED_TABLES = tuple(
    t.name for t in (operations, events, webhook_inbox, outbox, effects, route_keys)
)
REFERENCE_TABLES = ("payorch_alembic_version",)
DISTRIBUTE_HINT = "run `payorch db distribute` against the coordinator (idempotent)"

# Citus's own catalog, read only where the extension exists.
_PLACEMENT_SQL = """
SELECT c.relname, p.partmethod,
       CASE WHEN p.partmethod = 'h' THEN column_to_column_name(p.logicalrelid, p.partkey) END,
       p.colocationid,
       (SELECT count(*) FROM pg_dist_shard s WHERE s.logicalrelid = p.logicalrelid)
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = current_schema()
LEFT JOIN pg_dist_partition p ON p.logicalrelid = c.oid
WHERE c.relname = ANY(:names) AND c.relkind IN ('r', 'p')
"""


@dataclass(frozen=True)
class TablePlacement:
    """One table: ``local`` (on the coordinator only), ``distributed`` or ``reference``."""

    kind: str
    column: str | None = None
    colocation: int | None = None
    shards: int = 0


@dataclass(frozen=True)
class Placement:
    """Where payorch's tables are: ``citus`` is the extension's version (None: a plain
    PostgreSQL or SQLite), ``tables`` each table's placement, ``workers`` the nodes that
    hold shards."""

    citus: str | None = None
    tables: dict[str, TablePlacement] = field(default_factory=dict)
    workers: int = 0

    @property
    def distributed(self) -> bool:
        """payorch's operations are distributed (the work queues pick shard-locally)."""
        table = self.tables.get(DISTRIBUTED_TABLES[0])
        return table is not None and table.kind == "distributed"

    def as_dict(self) -> dict[str, Any]:
        return {
            "citus": self.citus,
            "distributed": self.distributed,
            "workers": self.workers,
            "tables": {
                name: {"placement": t.kind, "column": t.column, "shards": t.shards}
                for name, t in sorted(self.tables.items())
            },
        }

    def describe(self) -> str:
        if self.citus is None:
            return "single node (no Citus)"
        if not self.distributed:
            return f"Citus {self.citus}, payorch's tables not distributed"
        shards = self.tables[DISTRIBUTED_TABLES[0]].shards
        return (
            f"Citus {self.citus}, distributed by {DISTRIBUTION_COLUMN}: {shards} shards "
            f"per table on {self.workers} node(s)"
        )


_KINDS = {"h": "distributed", "n": "reference"}


def _read(conn: Connection) -> Placement:
    version = conn.execute(
        sa.text("SELECT extversion FROM pg_extension WHERE extname = 'citus'")
    ).scalar()
    if version is None:
        return Placement()
    names = [*DISTRIBUTED_TABLES, *REFERENCE_TABLES]
    tables: dict[str, TablePlacement] = {}
    for name, method, column, colocation, shards in conn.execute(
        sa.text(_PLACEMENT_SQL), {"names": names}
    ):
        kind = _KINDS.get(method, "local" if method is None else f"other ({method})")
        tables[name] = TablePlacement(kind, column, colocation, int(shards or 0))
    workers = conn.execute(
        sa.text(
            "SELECT count(*) FROM pg_dist_node WHERE isactive AND noderole = 'primary' "
            "AND shouldhaveshards"
        )
    ).scalar_one()
    return Placement(citus=str(version), tables=tables, workers=int(workers))


def read_placement(engine: Engine) -> Placement:
    """Where payorch's tables are (one short read; a plain ``Placement()`` on SQLite)."""
    if engine.dialect.name != "postgresql":
        return Placement()
    return read_in_transaction(engine, _read)


# How long a process trusts what it read: a schema distributed while services run is
# served shard-locally within this time (a restart is not needed).
PLACEMENT_TTL_S = 60.0
_SEEN: weakref.WeakKeyDictionary[Engine, tuple[bool, float]] = weakref.WeakKeyDictionary()
_SEEN_LOCK = threading.Lock()


def is_distributed(engine: Engine) -> bool:
    """payorch's tables are distributed on this engine's database (Citus): read once, then
    again after :data:`PLACEMENT_TTL_S`; always False on SQLite, and on a PostgreSQL whose
    connections' first-use check (which each pooled connection runs once anyway) found no
    Citus: no statement of its own there."""
    if engine.dialect.name != "postgresql":
        return False
    citus = sessions.citus_seen(engine)
    if citus is None:  # no connection used yet: use one now (its first-use check tells)
        read_in_transaction(engine, _nothing)
        citus = sessions.citus_seen(engine)
    if not citus:
        return False  # the connections' first-use check saw no Citus: no statement spent
    now = time.monotonic()
    with _SEEN_LOCK:
        seen = _SEEN.get(engine)
    if seen is not None and now - seen[1] < PLACEMENT_TTL_S:
        return seen[0]
    distributed = read_placement(engine).distributed
    with _SEEN_LOCK:
        _SEEN[engine] = (distributed, now)
    return distributed


def _nothing(conn: Connection) -> None:
    return None


def distributed_if_known(engine: Engine) -> bool | None:
    """What :func:`is_distributed` last found (False where no connection saw Citus), or
    None if it never looked: no I/O, for callers that may not wait on the database."""
    if engine.dialect.name != "postgresql" or sessions.citus_seen(engine) is False:
        return False
    with _SEEN_LOCK:
        seen = _SEEN.get(engine)
    return seen[0] if seen is not None else None


class Placed:
    """``distributed`` for :class:`~payorch.storage._store.Store` (a mixin)."""

    engine: Engine

    @property
    def distributed(self) -> bool:
        """payorch's tables are distributed by tenant (Citus): the work queues pick
        shard-locally, the waiters' NOTIFY is the coordinator's."""
        return is_distributed(self.engine)


def layout_problem(placement: Placement) -> str | None:
    """Why a payorch cannot serve this layout, or None. Served: every table local (a plain
    PostgreSQL, or Citus before ``db distribute``), or every table as ``db distribute``
    leaves it."""
    tables = {n: t for n, t in placement.tables.items() if n in DISTRIBUTED_TABLES}
    if placement.citus is None or all(t.kind == "local" for t in tables.values()):
        return None
    problems = []
    colocations = set()
    for name in DISTRIBUTED_TABLES:
        table = tables.get(name)
        if table is None:
            continue  # not created yet: `db upgrade` distributes it as it creates it
        if table.kind != "distributed":
            problems.append(f"{name} is {table.kind}")
        elif table.column != DISTRIBUTION_COLUMN:
            problems.append(f"{name} is distributed by {table.column}, not {DISTRIBUTION_COLUMN}")
        else:
            colocations.add(table.colocation)
    if len(colocations) > 1:
        problems.append("the tables are not co-located")
    if not problems:
        return None
    return (
        f"payorch's tables are partly distributed ({'; '.join(problems)}): every single-tenant "
        f"statement must reach one shard; {DISTRIBUTE_HINT}"
    )


def distribute(engine: Engine, *, shard_count: int | None = None) -> list[str]:
    """Distribute payorch's tables by tenant, co-located, and make the version table a
    reference table; what was done (empty when it already was). Idempotent.
    ``ConfigurationError`` in one line, before anything changes, on a database without
    Citus or with a table placed in a way this cannot mend."""
    if engine.dialect.name != "postgresql":
        raise ConfigurationError("db distribute needs PostgreSQL with Citus; this is SQLite")
    placement = read_placement(engine)
    if placement.citus is None:
        raise ConfigurationError(
            "db distribute needs the Citus extension in this database (CREATE EXTENSION "
            "citus on the coordinator, with its workers added); nothing changed"
        )
    # Tables a later migration creates are distributed as `db upgrade` creates them.
    missing = [n for n in (DISTRIBUTED_TABLES[0], *REFERENCE_TABLES) if n not in placement.tables]
    if missing:
        raise ConfigurationError(
            f"payorch's tables are missing ({', '.join(missing)}): run `payorch db upgrade` "
            "first; nothing changed"
        )
    present = [name for name in DISTRIBUTED_TABLES if name in placement.tables]
    for name in present:
        table = placement.tables[name]
        if table.kind == "distributed" and table.column != DISTRIBUTION_COLUMN:
            raise ConfigurationError(
                f"{name} is distributed by {table.column}, not {DISTRIBUTION_COLUMN}: "
                f"undistribute it (SELECT undistribute_table('{name}')) first; nothing changed"
            )
        if table.kind not in ("local", "distributed"):
            raise ConfigurationError(
                f"{name} is a {table.kind} table; payorch distributes it by "
                f"{DISTRIBUTION_COLUMN}: undistribute it first; nothing changed"
            )
    done: list[str] = []

    def txn(conn: Connection) -> None:
        first = DISTRIBUTED_TABLES[0]
        for name in present:
            if placement.tables[name].kind == "distributed":
                continue
            args: dict[str, Any] = {"t": name, "c": DISTRIBUTION_COLUMN}
            if name == first:
                extra = ", shard_count => :n" if shard_count is not None else ""
                args["n"] = shard_count
            else:
                extra, args["with"] = ", colocate_with => :with", first
            conn.execute(sa.text(f"SELECT create_distributed_table(:t, :c{extra})"), args)
            done.append(f"{name}: distributed by {DISTRIBUTION_COLUMN}")
        for name in REFERENCE_TABLES:
            if placement.tables[name].kind == "local":
                conn.execute(sa.text("SELECT create_reference_table(:t)"), {"t": name})
                done.append(f"{name}: reference table")

    run_in_transaction(engine, txn)
    with _SEEN_LOCK:
        _SEEN.pop(engine, None)
    return done
