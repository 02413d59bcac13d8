"""Run payorch's Alembic migrations programmatically (``payorch db upgrade|current``).

The migration scripts travel inside the package (``payorch/migrations`` in a wheel, the
repository's ``alembic/`` folder in a checkout). payorch records its revision in its own
table, ``payorch_alembic_version``, and its revisions carry the branch label ``payorch`` and
ids prefixed ``payorch_``, so it never reads or writes a host application's
``alembic_version``. A host that prefers one Alembic run for everything adds
:func:`versions_directory` to its own ``version_locations`` (see ``docs/embedding.md``).
"""

from __future__ import annotations

import io
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import exc
from sqlalchemy.engine import URL, Engine

from .errors import ConfigurationError, InvalidRequest
from .storage import _distribution as distribution
from .storage._engine import create_engine, map_db_error, schema_of
from .storage._pooling import normalise_url
from .storage._schema import MARKER_TABLE as _MARKER_TABLE
from .storage._schema import VERSION_TABLE, script_directory

__all__ = [
    "BRANCH",
    "VERSION_TABLE",
    "current_revision",
    "distribute",
    "downgrade",
    "ensure_schema",
    "head_revision",
    "script_directory",
    "upgrade",
    "versions_directory",
]

BRANCH = "payorch"


def versions_directory() -> Path:
    """The revision scripts, for a host project's ``version_locations``."""
    return script_directory() / "versions"


def _config(url: str | URL) -> Config:
    cfg = Config(stdout=io.StringIO())
    cfg.set_main_option("script_location", str(script_directory()))
    # Percent signs in passwords would be read as interpolation by configparser.
    rendered = normalise_url(url).render_as_string(hide_password=False)
    cfg.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    cfg.attributes["configure_logging"] = False
    return cfg


def ensure_schema(engine: Engine) -> None:
    """Create the PostgreSQL schema payorch's tables go to, if it is not there yet."""
    schema = schema_of(engine)
    if schema is None or schema == "public":
        return
    with engine.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))


def _inspect(url: str | URL) -> tuple[list[str], bool]:
    """(payorch's stored revisions, whether payorch's tables exist)."""
    engine = create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            inspector = sa.inspect(conn)
            has_marker = inspector.has_table(_MARKER_TABLE)
            has_version = inspector.has_table(VERSION_TABLE)
            revisions = (
                list(
                    MigrationContext.configure(
                        conn, opts={"version_table": VERSION_TABLE}
                    ).get_current_heads()
                )
                if has_version
                else []
            )
            return revisions, has_marker
    except exc.SQLAlchemyError as err:
        raise map_db_error(err) from err
    finally:
        engine.dispose()


def _check_known(url: str | URL, *, newer: bool = False) -> list[str]:
    """Refuse, in one line, a database payorch cannot safely migrate (``newer``: a revision
    this install does not know is returned, not refused: reading it is safe)."""
    if normalise_url(url).get_backend_name() == "sqlite" and not _sqlite_exists(url):
        return []
    revisions, has_marker = _inspect(url)
    if has_marker and not revisions:
        raise ConfigurationError(
            f"payorch's tables exist but {VERSION_TABLE} records no revision: if your own "
            "Alembic project runs payorch's migrations (`alembic upgrade heads`), upgrade "
            "there instead of `payorch db upgrade`"
        )
    if len(revisions) > 1:
        raise ConfigurationError(
            f"{VERSION_TABLE} holds {len(revisions)} revisions ({', '.join(revisions)}); "
            "payorch has one line of migrations: repair the table by hand"
        )
    known = {s.revision for s in ScriptDirectory(str(script_directory())).walk_revisions()}
    unknown = [r for r in revisions if r not in known]
    if unknown and not newer:
        raise ConfigurationError(
            f"database is at payorch revision {', '.join(unknown)}, which this version of "
            "payorch does not know: install the payorch release that migrated it"
        )
    return revisions


def _sqlite_exists(url: str | URL) -> bool:
    return Path(normalise_url(url).database or "").exists()


def upgrade(url: str | URL, revision: str = "heads") -> None:
    """Apply payorch's migrations up to ``revision`` (default: the newest)."""
    _check_known(url)
    if revision == "head":
        revision = "heads"
    try:
        command.upgrade(_config(url), revision)
    except CommandError as err:
        raise InvalidRequest(f"cannot upgrade to {revision!r}: {err}") from None
    except exc.SQLAlchemyError as err:
        raise map_db_error(err) from err
    _distribute_new_tables(url)


def _distribute_new_tables(url: str | URL) -> None:
    """On a schema already distributed, a table a migration created is distributed too
    (co-located): the schema stays one payorch can serve."""
    if normalise_url(url).get_backend_name() != "postgresql":
        return
    engine = create_engine(url, poolclass=sa.pool.NullPool)
    try:
        if distribution.read_placement(engine).distributed:
            distribution.distribute(engine)
    finally:
        engine.dispose()


def distribute(url: str | URL, *, shard_count: int | None = None) -> list[str]:
    """Distribute payorch's tables by tenant on a Citus coordinator (after :func:`upgrade`);
    what was done, empty when nothing was left to do. ``ConfigurationError`` in one line,
    nothing changed, where Citus is missing."""
    engine = create_engine(url, poolclass=sa.pool.NullPool)
    try:
        return distribution.distribute(engine, shard_count=shard_count)
    except exc.SQLAlchemyError as err:
        raise map_db_error(err) from err
    finally:
        engine.dispose()


def downgrade(url: str | URL, revision: str = "base") -> None:
    _check_known(url)
    try:
        command.downgrade(_config(url), revision)
    except CommandError as err:
        raise InvalidRequest(f"cannot downgrade to {revision!r}: {err}") from None
    except exc.SQLAlchemyError as err:
        raise map_db_error(err) from err


def head_revision() -> str | None:
    script = ScriptDirectory(str(script_directory()))
    try:
        return script.get_current_head()
    except CommandError as err:  # two heads in the package itself: a packaging bug
        raise ConfigurationError(f"payorch's migrations are inconsistent: {err}") from None


def current_revision(url: str | URL) -> str | None:
    """payorch's revision in this database (None: not set up yet), also one a newer payorch
    wrote (a rolling deploy that migrated first)."""
    revisions = _check_known(url, newer=True)
    return revisions[0] if revisions else None
