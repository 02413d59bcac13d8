"""Alembic environment of payorch's own migrations (``payorch db upgrade``).

payorch keeps its revision in its own version table, ``payorch_alembic_version``, so that it
can live in a database whose host application runs Alembic too. On PostgreSQL the tables go
to ``PAYORCH_DB_SCHEMA`` (default ``public``): the engine's ``search_path`` names it.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import pool

from payorch.migrate import VERSION_TABLE, ensure_schema
from payorch.storage._engine import create_engine

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logging", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    x_args = context.get_x_argument(as_dictionary=True)
    return (
        x_args.get("url")
        or config.get_main_option("sqlalchemy.url")
        or os.environ.get("PAYORCH_DATABASE_URL")
        or "sqlite:///payorch.db"
    )


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, render_as_batch=True, version_table=VERSION_TABLE)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    ensure_schema(engine)
    with engine.connect() as conn:
        context.configure(
            connection=conn,
            render_as_batch=True,
            transaction_per_migration=True,
            version_table=VERSION_TABLE,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    context.configure(url=_url(), literal_binds=True, version_table=VERSION_TABLE)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
