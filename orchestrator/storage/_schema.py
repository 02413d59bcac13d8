"""Which payorch schema a database holds, and the start-up check against this install.

``Store.check_schema()`` (``await AsyncStore.check_schema()``) is what every process that
serves payorch runs once as it starts: the FastAPI lifespan, the Django integration's first
use, the daemon. It reads payorch's revision in one statement (``payorch_alembic_version``)
and compares it with the newest revision this install carries. This install's head passes;
a revision it does not know passes too, with one WARNING (a newer payorch migrated it: in a
rolling deploy the migration runs first and the previous release keeps serving, as every
migration allows unless its changelog says otherwise). Anything else (no tables, an older
revision, several, tables without one, a Citus layout payorch cannot serve) is refused with
:class:`~payorch.errors.SchemaNotReady`, whose message names what was found and what to
run. Only a refusal reads more (whether payorch's tables exist at all, whether a host's
Alembic project records payorch's revision in its own ``alembic_version``); where Citus is
installed, one more catalog read tells how the tables are placed.

The migration scripts are found here too (:func:`script_directory`), so that the storage
layer knows this install's head without importing :mod:`payorch.migrate`, which is above it.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from urllib.parse import quote

import sqlalchemy as sa
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy.engine import URL, Connection, Engine

from ..errors import ConfigurationError, SchemaNotReady, StorageError
from ..observing import _logs as logs
from ._distribution import layout_problem, read_placement
from ._engine import read_in_transaction, schema_of
from ._sessions import citus_seen

__all__ = [
    "FORWARD_HINT",
    "HOST_VERSION_TABLE",
    "MARKER_TABLE",
    "UPGRADE_HINT",
    "VERSION_TABLE",
    "SchemaCheck",
    "check_schema",
    "known_revisions",
    "script_directory",
    "shown_url",
]

_log = logging.getLogger("payorch.db")

VERSION_TABLE = "payorch_alembic_version"
# Where a host's own Alembic project records payorch's revision when it runs payorch's
# migrations itself (docs/embedding.md, way (b)); payorch's revision ids start "payorch_".
HOST_VERSION_TABLE = "alembic_version"
MARKER_TABLE = "payorch_operations"
_PREFIX = "payorch_"
UPGRADE_HINT = (
    "run `payorch db upgrade` against this database (the same URL: PAYORCH_DATABASE_URL or "
    "--database-url), then start again"
)
FORWARD_HINT = (
    "roll the code forward; a migration keeps the previous release working unless its "
    "changelog says otherwise"
)
# A query parameter whose value is a credential (libpq's password, sslpassword; a driver's
# token): masked like the URL's own password. A path (passfile, sslkey) is shown.
_SECRET_PARTS = ("password", "passwd", "secret", "token")
_DENIED = "42501"  # insufficient_privilege


def script_directory() -> Path:
    """Where the migration environment lives: inside the package, or the checkout's folder."""
    here = Path(__file__).resolve().parents[1]
    for candidate in (here / "migrations", here.parent / "alembic"):
        if (candidate / "env.py").is_file() and (candidate / "versions").is_dir():
            return candidate
    raise ConfigurationError(f"payorch's migrations are missing from {here} (a broken install?)")


@functools.cache
def known_revisions() -> tuple[str, frozenset[str]]:
    """This install's head revision and every revision it knows (read once per process:
    the scripts travel in the package and do not change while it runs)."""
    script = ScriptDirectory(str(script_directory()))
    try:
        head = script.get_current_head()
    except CommandError as err:  # two heads in the package itself: a packaging bug
        raise ConfigurationError(f"payorch's migrations are inconsistent: {err}") from None
    if head is None:
        raise ConfigurationError("payorch's migrations are empty (a broken install?)")
    return head, frozenset(s.revision for s in script.walk_revisions())


def shown_url(url: URL) -> str:
    """``url`` for a log line or a terminal: its password masked, in the netloc and in the
    query (``?password=``, ``?sslpassword=``, any parameter naming a secret or token)."""
    bare = url.set(query={}).render_as_string(hide_password=True)
    pairs = []
    for name, value in url.query.items():
        secret = any(part in name.lower() for part in _SECRET_PARTS)
        for one in (value,) if isinstance(value, str) else value:
            pairs.append(f"{quote(name)}={'***' if secret else quote(one, safe='/:,=-')}")
    return f"{bare}?{'&'.join(pairs)}" if pairs else bare


def _where(engine: Engine) -> str:
    # The URL without its credentials (the message goes to logs, terminals, /readyz), and as
    # the user wrote it: the async API's SQLite driver is payorch's choice, not theirs.
    url = engine.url
    if url.drivername == "sqlite+aiosqlite":
        url = url.set(drivername="sqlite")
    shown = shown_url(url)
    schema = schema_of(engine)
    return f"{shown} (schema {schema})" if schema not in (None, "public") else shown


def _versions(name: str) -> sa.Select[str]:
    return sa.select(sa.column("version_num", sa.String)).select_from(sa.table(name))


def _stored(conn: Connection) -> list[str]:
    return [str(v) for v in conn.execute(_versions(VERSION_TABLE)).scalars()]


def _host_recorded(conn: Connection) -> tuple[bool, list[str]]:
    """Only when payorch's version table is missing: (payorch's tables exist, payorch's
    revisions in a host's ``alembic_version``)."""
    inspector = sa.inspect(conn)
    if not inspector.has_table(MARKER_TABLE):
        return False, []
    if not inspector.has_table(HOST_VERSION_TABLE):
        return True, []
    found = conn.execute(_versions(HOST_VERSION_TABLE)).scalars()
    return True, [str(v) for v in found if str(v).startswith(_PREFIX)]


def _stored_or_none(engine: Engine, where: str) -> list[str] | None:
    """The revisions in payorch's version table; ``None`` if that table is missing."""
    try:
        return read_in_transaction(engine, _stored)
    except SchemaNotReady:  # the statement met no payorch_alembic_version
        return None
    except StorageError as err:
        orig = getattr(err.__cause__, "orig", None)
        if getattr(orig, "sqlstate", None) != _DENIED:
            raise
        raise SchemaNotReady(
            f"the application's role may not read {VERSION_TABLE} in {where} (permission "
            f"denied): grant SELECT on {VERSION_TABLE} to the application's role (as on "
            "payorch's other tables), then start again"
        ) from err


def check_schema(engine: Engine) -> str:
    """The database's payorch revision, if it is this install's head or one this install
    does not know (a newer payorch's: one WARNING); else :class:`SchemaNotReady` naming
    what was found and what to do."""
    head, known = known_revisions()
    where = _where(engine)
    revisions = _stored_or_none(engine, where)
    if revisions is None:  # no payorch_alembic_version: look closer, this once
        has_tables, revisions = read_in_transaction(engine, _host_recorded)
        if not has_tables:
            raise SchemaNotReady(
                f"no payorch tables in {where}; this payorch needs revision {head}: {UPGRADE_HINT}"
            )
        if not revisions:
            raise SchemaNotReady(
                f"payorch's tables exist in {where} but no revision is recorded (neither "
                f"{VERSION_TABLE} nor {HOST_VERSION_TABLE}): if your own Alembic project "
                "runs payorch's migrations, run `alembic upgrade heads` there; otherwise "
                "repair the version table by hand"
            )
    if not revisions:
        raise SchemaNotReady(
            f"{VERSION_TABLE} in {where} records no revision; this payorch needs {head}: "
            f"{UPGRADE_HINT}"
        )
    if len(revisions) > 1:
        raise SchemaNotReady(
            f"{where} records {len(revisions)} payorch revisions ({', '.join(revisions)}); "
            "payorch has one line of migrations: repair the version table by hand"
        )
    found = revisions[0]
    _check_layout(engine, where)
    if found == head:
        return found
    if found in known:
        raise SchemaNotReady(
            f"{where} is at payorch revision {found}; this payorch needs {head}: {UPGRADE_HINT}"
        )
    # A newer payorch migrated it: a rolling deploy migrates first, and this release keeps
    # serving until it is replaced. Said once per start, never refused.
    logs.emit(
        _log,
        logging.WARNING,
        "database.schema_newer",
        database=where,
        found=found,
        head=head,
        advice=FORWARD_HINT,
    )
    return found


def _check_layout(engine: Engine, where: str) -> None:
    """A distributed schema this payorch cannot serve (partly distributed, by another
    column, not co-located) is refused with the reason; one catalog read on PostgreSQL."""
    if citus_seen(engine) is False:
        return  # the revision's read reached no Citus: nothing more to read
    problem = layout_problem(read_placement(engine))
    if problem is not None:
        raise SchemaNotReady(f"{where}: {problem}")


class SchemaCheck:
    """The store's start-up check (a mixin of :class:`~payorch.storage._store.Store`)."""

    engine: Engine

    def check_schema(self) -> str:
        """Refuse to serve on a database whose payorch schema is behind this install's:
        ``SchemaNotReady`` (missing, older: run ``payorch db upgrade``). A newer revision
        (a newer payorch migrated it) is served, with one WARNING. One read; returns the
        revision. Call it once as a process starts."""
        return check_schema(self.engine)
