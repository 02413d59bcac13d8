"""PostgreSQL's floors, and payorch's own statements driven by hand.

* **floor**: the issue's protocol, raw psycopg, one statement per phase, in autocommit on a
  connection per thread: ``INSERT … ON CONFLICT DO NOTHING RETURNING id, version`` (its own
  commit, one round trip), then the version-fenced ``UPDATE … RETURNING version`` (one
  round trip). The **replay floor** is one statement too: a CTE whose INSERT finds the key
  taken and whose SELECT reads the row.
* **same SQL**: the two statements one ``execute()`` sends, captured at the psycopg cursor
  (not re-typed), run in raw psycopg, autocommit, a connection per thread, on payorch's own
  tables, with fresh ids and keys filled in per operation: what payorch's SQL (its wider
  rows, its JSON) costs the client without the library around it.

:class:`Template` fills captured values with fresh ids; the async HTTP benchmark uses it for
the sandbox adapter's captured request as well.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import bench_execute as bx
import psycopg

from payorch import Executor, Store
from payorch.operations import default_registry
from payorch.storage._store import new_id

__all__ = [
    "PG_FLOOR_INSERT",
    "PG_FLOOR_UPDATE",
    "Captured",
    "Template",
    "capture_execute",
    "pg_floor_workload",
    "pg_replay_floor_workload",
    "pg_same_sql_workload",
    "prepare_pg_floors",
]

# -- the floor ---------------------------------------------------------------------------------

PG_FLOOR_DDL = """
CREATE TABLE IF NOT EXISTS bench_floor (
    tenant_id varchar(64) NOT NULL,
    id varchar(36) NOT NULL,
    operation varchar(64) NOT NULL,
    idempotency_key varchar(255) NOT NULL,
    state varchar(20) NOT NULL,
    provider_reference varchar(255),
    version integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (tenant_id, id),
    UNIQUE (tenant_id, operation, idempotency_key)
)
"""

PG_FLOOR_INSERT = """
INSERT INTO bench_floor (tenant_id, id, operation, idempotency_key, state, version)
VALUES (%s, %s, %s, %s, 'in_progress', 1)
ON CONFLICT (tenant_id, operation, idempotency_key) DO NOTHING
RETURNING id, version
"""

PG_FLOOR_UPDATE = """
UPDATE bench_floor
SET state = 'succeeded', provider_reference = %s, version = version + 1,
    updated_at = clock_timestamp()
WHERE tenant_id = %s AND id = %s AND version = %s
RETURNING version
"""

# One round trip: the INSERT finds the key taken (the snapshot of the statement sees the
# committed row), the second branch reads it.
PG_FLOOR_REPLAY = """
WITH ins AS (
    INSERT INTO bench_floor (tenant_id, id, operation, idempotency_key, state, version)
    VALUES (%(tenant)s, %(id)s, %(operation)s, %(key)s, 'in_progress', 1)
    ON CONFLICT (tenant_id, operation, idempotency_key) DO NOTHING
    RETURNING id, version, state, provider_reference
)
SELECT true, id, version, state, provider_reference FROM ins
UNION ALL
SELECT false, id, version, state, provider_reference FROM bench_floor
WHERE tenant_id = %(tenant)s AND operation = %(operation)s AND idempotency_key = %(key)s
    AND NOT EXISTS (SELECT FROM ins)
"""


def prepare_pg_floors(conninfo: str) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(PG_FLOOR_DDL)


def pg_floor_workload(conninfo: str, tenant: str) -> Callable[[str], bx.Factory]:
    """Per operation, in autocommit: the INSERT (one round trip, its own commit), then the
    fenced UPDATE (one round trip, its own commit)."""

    def factory_for(prefix: str) -> bx.Factory:
        def factory(t: int) -> bx.Worker:
            conn = psycopg.connect(conninfo, autocommit=True)

            def op(i: int) -> bool:
                row = conn.execute(
                    PG_FLOOR_INSERT, (tenant, new_id(), bx.OPERATION, bx.key(prefix, t, i))
                ).fetchone()
                if row is None:
                    return False
                op_id, version = row
                done = conn.execute(
                    PG_FLOOR_UPDATE, (f"ref_{op_id}", tenant, op_id, version)
                ).fetchone()
                return done is not None

            return bx.Worker(op, conn.close)

        return factory

    return factory_for


def pg_replay_floor_workload(conninfo: str, tenant: str) -> Callable[[str], bx.Factory]:
    """Keys the floor already drove to succeeded: one statement finds each taken, reads it."""

    def factory_for(prefix: str) -> bx.Factory:
        def factory(t: int) -> bx.Worker:
            conn = psycopg.connect(conninfo, autocommit=True)

            def op(i: int) -> bool:
                params = {
                    "tenant": tenant,
                    "id": new_id(),
                    "operation": bx.OPERATION,
                    "key": bx.key(prefix, t, i),
                }
                row = conn.execute(PG_FLOOR_REPLAY, params).fetchone()
                return row is not None and not row[0] and row[3] == "succeeded"

            return bx.Worker(op, conn.close)

        return factory

    return factory_for


# -- captured values, filled afresh per operation -------------------------------------------

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_REF = re.compile(r"payorch:([0-9a-f]{8,}):")  # the namespace ref inside a downstream key


def _texts(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _texts(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _texts(v)


def _subst(value: Any, fresh: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        for old, new in fresh.items():
            if old in value:
                value = value.replace(old, new)
        return value
    if isinstance(value, Mapping):
        return {k: _subst(v, fresh) for k, v in value.items()}
    if isinstance(value, list):
        return [_subst(v, fresh) for v in value]
    return value


class Template:
    """Captured values whose per-operation parts are replaced by fresh ones.

    Per-operation parts: every UUID (operation and event ids), the client's idempotency key
    the capture used, and the namespace ref of a downstream key (``payorch:<ref>:…``).
    :meth:`fresh` maps each to a new value for one operation (new ids; the ref derived from
    the new key, as payorch derives it from the namespace); :meth:`fill` applies a mapping
    to a value (text, or parsed JSON) without touching what does not vary.
    """

    def __init__(self, key: str, values: Iterable[Any]) -> None:
        self.key = key
        texts = [t for v in values for t in _texts(v)]
        self.ids = list(dict.fromkeys(m for t in texts for m in _UUID.findall(t)))
        self.refs = list(dict.fromkeys(m for t in texts for m in _REF.findall(t)))

    def fresh(self, key: str) -> dict[str, str]:
        out = {self.key: key}
        for old in self.ids:
            out[old] = new_id()
        digest = hashlib.sha256(key.encode()).hexdigest()
        for old in self.refs:
            out[old] = digest[: len(old)]
        return out

    def varies(self, value: Any) -> bool:
        tokens = [self.key, *self.ids, *self.refs]
        return any(tok in t for t in _texts(value) for tok in tokens)

    @staticmethod
    def fill(value: Any, fresh: Mapping[str, str]) -> Any:
        return _subst(value, fresh)


# -- payorch's statements, captured and driven by hand -----------------------------------------


@dataclass(frozen=True, kw_only=True)
class Captured:
    sql: str
    params: dict[str, Any]


def capture_execute(url: str, tenant: str, owner: str) -> tuple[list[Captured], str]:
    """Run one ``execute()`` (instant provider) on a store whose psycopg cursors record what
    they run; the statements that write payorch's operations table, and the key used."""
    from payorch.storage._tables import operations

    seen: list[Captured] = []

    class Recording(psycopg.Cursor[Any]):
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            text = str(query)
            if operations.name in text:
                seen.append(Captured(sql=text, params=dict(params or {})))
            return super().execute(query, params, **kwargs)

    probe = Store.from_url(url, connect_args={"cursor_factory": Recording})
    executor = Executor(
        store=probe,
        providers=[bx.InstantProvider()],
        registry=default_registry(provider="instant"),
        lease=timedelta(seconds=30),
        owner=owner,
    )
    key = f"capture-key-{new_id()[-12:]}"
    try:
        executor.execute(
            tenant_id=tenant, operation=bx.OPERATION, idempotency_key=key, request=bx.REQUEST
        )
    finally:
        probe.close()
    if len(seen) != 2:
        heads = [c.sql.split("\n", 1)[0][:60] for c in seen]
        raise RuntimeError(f"one execute() sent {len(seen)} statements on its table: {heads}")
    return seen, key


class _Statement:
    """One captured statement: its SQL, its constant parameters, and those filled per op
    (text with ids or keys in it; JSON, parsed once, substituted and encoded per op)."""

    def __init__(self, captured: Captured, template: Template) -> None:
        self.sql = captured.sql
        self.const: dict[str, Any] = {}
        self.texts: list[tuple[str, str]] = []
        self.jsons: list[tuple[str, Any]] = []
        for name, value in captured.params.items():
            if not template.varies(value):
                self.const[name] = value
            elif isinstance(value, str) and f"%({name})s::json" in self.sql:
                self.jsons.append((name, json.loads(value)))
            else:
                self.texts.append((name, value))
        # The fence: taken from the row the claim returned, not from the capture.
        self.version_params = [
            n for n, v in captured.params.items() if n.endswith("version") and isinstance(v, int)
        ]

    def params(self, fresh: Mapping[str, str]) -> dict[str, Any]:
        out = dict(self.const)
        for name, text in self.texts:
            out[name] = _subst(text, fresh)
        for name, obj in self.jsons:
            out[name] = json.dumps(_subst(obj, fresh))
        return out


def pg_same_sql_workload(
    conninfo: str, captured: list[Captured], key: str
) -> Callable[[str], bx.Factory]:
    """payorch's claim and its transition, as captured, in raw psycopg (autocommit, a
    connection per thread), fresh ids and key per operation; the transition's version fence
    from the claim's row."""
    template = Template(key, [c.params for c in captured])
    claim, record = (_Statement(c, template) for c in captured)

    def factory_for(prefix: str) -> bx.Factory:
        def factory(t: int) -> bx.Worker:
            conn = psycopg.connect(conninfo, autocommit=True)
            version_at: list[int] = []  # the claim row's version column, found once

            def op(i: int) -> bool:
                fresh = template.fresh(bx.key(prefix, t, i))
                cur = conn.execute(claim.sql, claim.params(fresh))
                row = cur.fetchone()
                if row is None:
                    return False
                if not version_at:
                    names = [d.name for d in cur.description or ()]
                    version_at.append(names.index("version"))
                params = record.params(fresh)
                for name in record.version_params:
                    params[name] = row[version_at[0]]
                done = conn.execute(record.sql, params).fetchone()
                return done is not None

            return bx.Worker(op, conn.close)

        return factory

    return factory_for
