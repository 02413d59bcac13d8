"""A host application's Alembic environment, as a service that embeds payorch has one.

Two ways payorch's migrations meet the host's (the tests build the Config for each):

- ``beside``: the host migrates only its own tables; ``payorch db upgrade`` runs separately
  and keeps its revision in ``payorch_alembic_version``.
- ``include``: the host's ``alembic upgrade heads`` runs payorch's revisions too (they are
  a branch labelled ``payorch``), recorded in the host's own ``alembic_version``: the host
  adds ``payorch.migrate.versions_directory()`` to its ``version_locations``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

config = context.config

engine = create_engine(config.get_main_option("sqlalchemy.url") or "", poolclass=pool.NullPool)
with engine.connect() as conn:
    context.configure(connection=conn, render_as_batch=True, transaction_per_migration=True)
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
