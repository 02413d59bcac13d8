"""PostgreSQL behind a connection pooler (PgBouncer): what changes and where LISTEN goes.

Behind a transaction-pooling PgBouncer each transaction may run on another server
connection, so nothing of a session outlives a transaction. payorch's statements rely on
none of it, but three things are per session and are handled here:

* psycopg prepares a statement on the server after it ran five times on one connection;
  PgBouncer before 1.21 (and later ones without ``max_prepared_statements``) cannot follow
  it to another server connection. In ``transaction`` mode the engine's connections never
  prepare (``prepare_threshold=None``) unless the caller's ``connect_args`` say otherwise.
* The schema's ``search_path`` is a startup parameter (``options``), which PgBouncer refuses
  (or, listed in ``ignore_startup_parameters``, drops). In ``transaction`` mode payorch does
  not send it; the server must set it (``ALTER ROLE ... SET search_path``), and each new
  connection checks that it does.
* LISTEN holds only on the server connection it ran on. In ``transaction`` mode waiters
  listen on ``listen_url`` (a direct connection to the server) if one is given, and poll
  otherwise.

Settings: ``PAYORCH_DATABASE_POOLER`` (``none``, ``session`` or ``transaction``; default
``none``) and ``PAYORCH_LISTEN_DATABASE_URL``, or ``create_engine(..., pooler=...,
listen_url=...)``.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event, exc
from sqlalchemy.engine import URL, Engine, make_url

from ..errors import ConfigurationError, InvalidRequest
from ._sessions import conninfo

__all__ = [
    "LISTEN_URL_ENV",
    "POOLER_ENV",
    "POOLER_MODES",
    "Pooling",
    "listen_dsn",
    "normalise_url",
    "pooling_of",
    "resolve",
]

POOLER_ENV = "PAYORCH_DATABASE_POOLER"
LISTEN_URL_ENV = "PAYORCH_LISTEN_DATABASE_URL"
POOLER_MODES = ("none", "session", "transaction")


@dataclass(frozen=True)
class Pooling:
    """What stands between an engine and the server, and where its waiters listen."""

    pooler: str = "none"
    listen_url: URL | None = None

    @property
    def per_transaction(self) -> bool:
        """Whether a server connection is held for one transaction only."""
        return self.pooler == "transaction"


def normalise_url(url: str | URL) -> URL:
    try:
        parsed = make_url(url)
    except exc.ArgumentError as err:
        raise InvalidRequest(f"not a database URL: {url!s}") from err
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("postgresql", "sqlite"):
        raise InvalidRequest(f"unsupported database {parsed.get_backend_name()!r}")
    if parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:"):
        # Many threads and processes share the store; an in-memory database cannot.
        raise InvalidRequest("SQLite needs a file path, e.g. sqlite:///payorch.db")
    return parsed


def resolve(pooler: str | None = None, listen_url: str | URL | None = None) -> Pooling:
    """The pooling of an engine: the arguments, else ``PAYORCH_DATABASE_POOLER`` and
    ``PAYORCH_LISTEN_DATABASE_URL`` (read here, as the schema is: an engine must not fail
    on an unrelated setting)."""
    mode = (pooler if pooler is not None else os.environ.get(POOLER_ENV) or "none").lower()
    if mode == "statement":
        raise ConfigurationError(
            "statement pooling cannot run payorch: its writes are multi-statement "
            "transactions; use pool_mode = transaction"
        )
    if mode not in POOLER_MODES:
        raise ConfigurationError(f"{POOLER_ENV}={mode!r}: use one of {', '.join(POOLER_MODES)}")
    target = listen_url if listen_url is not None else os.environ.get(LISTEN_URL_ENV) or None
    if target is None:
        return Pooling(mode)
    parsed = normalise_url(target)
    if parsed.get_backend_name() != "postgresql":
        raise ConfigurationError(f"{LISTEN_URL_ENV} must be a PostgreSQL URL, not {parsed!r}")
    return Pooling(mode, parsed)


def engine_options(pooling: Pooling, kwargs: dict[str, Any]) -> None:
    """Fill ``kwargs`` (``create_engine``'s) for ``pooling``."""
    if pooling.per_transaction:
        connect_args = dict(kwargs.pop("connect_args", {}))
        # Server-side prepared statements are per server connection (see the docstring).
        connect_args.setdefault("prepare_threshold", None)
        kwargs["connect_args"] = connect_args


_POOLINGS: weakref.WeakKeyDictionary[Engine, Pooling] = weakref.WeakKeyDictionary()


def configure(engine: Engine, pooling: Pooling, schema: str) -> None:
    """Remember ``pooling`` for ``engine``; in ``transaction`` mode with a schema of its
    own, check on each new connection that the server puts the schema first."""
    _POOLINGS[engine] = pooling
    if pooling.per_transaction and schema != "public":

        @event.listens_for(engine, "connect")
        def _check_search_path(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            try:
                cursor.execute("SELECT current_setting('search_path')")
                row = cursor.fetchone()
            finally:
                cursor.close()
                dbapi_conn.rollback()  # no transaction left open to pin a server connection
            first = str(row[0] if row else "").split(",")[0].strip().strip('"')
            if first != schema:
                raise ConfigurationError(
                    f"behind a transaction pooler the server must put schema {schema!r} "
                    f"first in search_path (it has {row[0] if row else ''!r}): "
                    f"ALTER ROLE ... SET search_path = {schema}"
                )


def pooling_of(engine: Engine) -> Pooling:
    """How ``engine`` reaches the server: as given to :func:`payorch.db.create_engine`,
    else (an engine payorch did not build) as the environment says."""
    found = _POOLINGS.get(engine)
    if found is None:
        found = _POOLINGS[engine] = resolve()
    return found


def listen_dsn(engine: Engine) -> str | None:
    """Where the waiters' LISTEN connection goes (a libpq conninfo), or None: they poll.

    ``listen_url`` if given; else the engine's own server, unless that is reached through
    a transaction pooler, where a LISTEN would hold on whichever server connection it ran.
    """
    pooling = pooling_of(engine)
    url = pooling.listen_url
    if url is None:
        if pooling.per_transaction:
            return None
        url = engine.url
    # As the dialect reads it: a multi-host URL (?host=a:1&host=b:2) is no libpq URL.
    return conninfo(engine, url)
