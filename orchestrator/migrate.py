"""Run the Alembic migrations programmatically (``payorch db upgrade|current``)."""

from __future__ import annotations

import io
import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import exc
from sqlalchemy.engine import URL

from .db import create_engine, map_db_error, normalise_url
from .errors import ConfigurationError, InvalidRequest

__all__ = ["current_revision", "downgrade", "head_revision", "upgrade"]


def _script_location() -> Path:
    override = os.environ.get("PAYORCH_ALEMBIC_DIR")
    path = Path(override) if override else Path(__file__).resolve().parent.parent / "alembic"
    if not (path / "env.py").is_file():
        raise ConfigurationError(f"alembic migrations not found at {path}")
    return path


def _config(url: str | URL) -> Config:
    cfg = Config(stdout=io.StringIO())
    cfg.set_main_option("script_location", str(_script_location()))
    # Percent signs in passwords would be read as interpolation by configparser.
    rendered = normalise_url(url).render_as_string(hide_password=False)
    cfg.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    cfg.attributes["configure_logging"] = False
    return cfg


def upgrade(url: str | URL, revision: str = "head") -> None:
    try:
        command.upgrade(_config(url), revision)
    except CommandError as err:
        raise InvalidRequest(f"cannot upgrade to {revision!r}: {err}") from None
    except exc.SQLAlchemyError as err:
        raise map_db_error(err) from err


def downgrade(url: str | URL, revision: str = "base") -> None:
    try:
        command.downgrade(_config(url), revision)
    except CommandError as err:
        raise InvalidRequest(f"cannot downgrade to {revision!r}: {err}") from None
    except exc.SQLAlchemyError as err:
        raise map_db_error(err) from err


def head_revision() -> str | None:
    script = ScriptDirectory(str(_script_location()))
    return script.get_current_head()


def current_revision(url: str | URL) -> str | None:
    parsed = normalise_url(url)
    if parsed.get_backend_name() == "sqlite" and not Path(parsed.database or "").exists():
        return None  # asking must not create the file
    engine = create_engine(parsed)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except exc.SQLAlchemyError as err:
        raise map_db_error(err) from err
    finally:
        engine.dispose()
