"""Engines made the way payorch makes them (the public face of
:mod:`payorch.storage._engine`).

``create_engine(url, pooler=…)`` is what :meth:`payorch.Store.from_url` uses: a pool fit for
payorch's transactions, the pooler's session rules (PgBouncer), and errors mapped to
``payorch.errors``. Hand its engine to ``Store(engine)`` when you configure one yourself.
"""

from __future__ import annotations

from .storage._engine import create_async_engine, create_engine

__all__ = ["create_async_engine", "create_engine"]
