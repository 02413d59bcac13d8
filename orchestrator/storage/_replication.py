"""How the PostgreSQL payorch writes to is replicated, and the strict setting that needs it.

:func:`read_status` asks the server once (one statement): whether it is a primary, the
session's ``synchronous_commit``, ``synchronous_standby_names`` and how many standbys stream
(and how many of them synchronously) per ``pg_stat_replication``. Its :attr:`~Status.mode`:

==================  ===========================================================================
``sync``            commits wait for enough synchronous standbys, and that many are streaming
``sync_blocked``    commits wait for synchronous standbys that are not streaming: writes hang
``async``           standbys stream, commits do not wait for any (a failover loses the newest)
``none``            no standby streams and none is waited for
``unknown``         commits wait for standbys, but the role may not see ``pg_stat_replication``
                    (grant it ``pg_monitor``)
``read_only``       a standby or a read-only session: payorch refuses it
``local``           SQLite: one file, no replication
==================  ===========================================================================

:class:`Guard` is the store's: with ``require_sync_standby`` (``PAYORCH_REQUIRE_SYNC_STANDBY``)
a store refuses to start unless the mode is ``sync``, and checks it again before every claim
(one more round trip): no claim is made while no synchronous standby streams
(:class:`~payorch.errors.SyncStandbyUnavailable`, retry the same key). A standby that leaves
between that check and the claim's commit makes the commit wait for it (or, if the cluster
manager drops the standby from the list meanwhile, commit unreplicated): Patroni's
``synchronous_mode_strict`` closes that last gap on the server's side.

:func:`report` logs the mode once at start-up (``payorch.db``, event ``database.replication``)
with what it means for payorch (``meaning``): INFO when nothing is at risk (``sync``,
``none``: no standby to fail over to, ``local``), WARNING when it is (``async``: a failover
may lose the newest commits; ``sync_blocked``: writes hang; ``unknown``: the standbys are
hidden from the role).
"""

from __future__ import annotations

import logging
import os
import re
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ..errors import ConfigurationError, DatabaseReadOnly, SyncStandbyUnavailable
from ..observing import _logs as logs
from ._driver_sql import run_sql
from ._engine import read_in_transaction
from ._sessions import refuse_autocommit

__all__ = [
    "ENV_STRICT",
    "MEANINGS",
    "MODES",
    "Guard",
    "Status",
    "gate",
    "read_status",
    "report",
    "strict_from_env",
]

ENV_STRICT = "PAYORCH_REQUIRE_SYNC_STANDBY"
MODES = ("sync", "sync_blocked", "async", "none", "unknown", "read_only", "local")
# synchronous_commit values that wait for a synchronous standby (local and off do not).
_WAITING = frozenset({"on", "remote_write", "remote_apply"})
_NUM_SYNC = re.compile(r"^\s*(?:(?:first|any)\s+)?(\d+)\s*\(", re.IGNORECASE)

db_log = logging.getLogger("payorch.db")
_REFUSALS = {
    "local": "SQLite has no standby",
    "read_only": "the database is a standby or the session is read-only",
    "unknown": "pg_stat_replication hides the standbys from this role (GRANT pg_monitor TO it)",
}

# One statement, read by anyone: settings are public, and pg_stat_replication shows every
# walsender's row to every role (its details to pg_read_all_stats / pg_monitor only: a
# hidden row has a NULL state).
STATUS_SQL = """
SELECT pg_is_in_recovery(),
       current_setting('transaction_read_only'),
       current_setting('synchronous_standby_names'),
       current_setting('synchronous_commit'),
       count(*) FILTER (WHERE r.state = 'streaming'),
       count(*) FILTER (WHERE r.state = 'streaming' AND r.sync_state IN ('sync', 'quorum')),
       count(*) FILTER (WHERE r.state IS NULL),
       current_setting('lc_messages')
FROM pg_stat_replication AS r
"""


def num_sync(names: str) -> int:
    """How many synchronous standbys ``synchronous_standby_names`` waits for (0: none):
    ``FIRST 2 (a, b, c)``, ``ANY 2 (…)`` and ``2 (…)`` say so; a plain list or ``*``
    waits for one."""
    if not names.strip():
        return 0
    found = _NUM_SYNC.match(names)
    return int(found.group(1)) if found else 1


@dataclass(frozen=True, kw_only=True)
class Status:
    """One reading of the server's replication (PostgreSQL) or SQLite's ``local``."""

    mode: str
    synchronous_standby_names: str | None = None
    synchronous_commit: str | None = None
    required_sync_standbys: int = 0
    standbys_streaming: int | None = None  # None: pg_stat_replication hides them
    sync_standbys_streaming: int | None = None
    lc_messages: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> Status:
        recovering, read_only, names, commit, streaming, sync, hidden, lc = row
        need = num_sync(names)
        visible = not hidden
        waits = need > 0 and commit in _WAITING
        if recovering or read_only == "on":
            mode = "read_only"
        elif not waits:
            mode = "async" if streaming or hidden else "none"
        elif not visible:
            mode = "unknown"
        else:
            mode = "sync" if sync >= need else "sync_blocked"
        return cls(
            mode=mode,
            synchronous_standby_names=names,
            synchronous_commit=commit,
            required_sync_standbys=need,
            standbys_streaming=int(streaming) if visible else None,
            sync_standbys_streaming=int(sync) if visible else None,
            lc_messages=lc,
        )

    @property
    def synchronous(self) -> bool:
        """Every commit is on a synchronous standby before it is acknowledged."""
        return self.mode == "sync"

    def describe(self) -> str:
        """One line for people: the mode and what it rests on."""
        if self.mode == "local":
            return "local: SQLite, one file, no replication"
        if self.mode == "read_only":
            return "read_only: a standby or a read-only session (payorch writes to the primary)"
        names = self.synchronous_standby_names or ""
        standbys = "?" if self.standbys_streaming is None else str(self.standbys_streaming)
        sync = "?" if self.sync_standbys_streaming is None else str(self.sync_standbys_streaming)
        return (
            f"{self.mode}: synchronous_standby_names={names!r}, "
            f"synchronous_commit={self.synchronous_commit}, {sync} of "
            f"{self.required_sync_standbys} synchronous standbys streaming, "
            f"{standbys} standbys streaming"
        )

    def refusal(self) -> str | None:
        """Why a store that requires a synchronous standby may not claim now (None: it may)."""
        if self.synchronous:
            return None
        fixed = _REFUSALS.get(self.mode)
        if fixed is not None:
            return fixed
        if self.required_sync_standbys == 0:
            return "synchronous_standby_names is empty: no standby is synchronous"
        if self.synchronous_commit not in _WAITING:
            return f"synchronous_commit={self.synchronous_commit} does not wait for a standby"
        return (
            f"{self.sync_standbys_streaming} of {self.required_sync_standbys} synchronous "
            "standbys streaming"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "synchronous": self.synchronous, "summary": self.describe()}


def read_status(engine: Engine) -> Status:
    """The replication status, in one statement (SQLite: one trivial read, ``local``).
    Raises ``DatabaseReadOnly`` for a standby or a read-only session (on the connection's
    first use), ``StorageError`` when the database does not answer."""
    if engine.dialect.name != "postgresql":
        read_in_transaction(engine, lambda conn: conn.execute(sa.select(1)).scalar_one())
        return Status(mode="local")
    return Status.from_row(run_sql(engine, STATUS_SQL, {}, write=False))


# What each mode means for payorch's promise, said in the start-up line itself: a bare
# "mode=none" at WARNING in every process's log told operators nothing.
MEANINGS = {
    "sync": "every commit is on a synchronous standby before it is acknowledged: a failover "
    "loses no commit",
    "sync_blocked": "commits wait for a synchronous standby that is not streaming: writes hang "
    "until one is back",
    "async": "standbys stream but no commit waits for one: a failover may lose the newest "
    "commits (a claim, an outcome); a client's retry then sends the same downstream key "
    "(derived from the namespace), which keeps the provider from charging twice within its "
    "idempotency window, and the reconciler settles what is left unknown from the provider",
    "none": "no standby is configured or streaming: no failover can lose a commit (durability "
    "is this server's alone)",
    "unknown": "commits wait for standbys this role cannot see (GRANT pg_monitor TO it): "
    "whether a synchronous one streams is not known",
    "read_only": "a standby or a read-only session: payorch writes to the primary",
    "local": "SQLite: one file, no replication",
}
# Modes that put something at risk (lost commits, hung writes, or a risk payorch cannot see).
_AT_RISK = frozenset({"async", "sync_blocked", "unknown", "read_only"})


def report(status: Status, *, strict: bool = False) -> None:
    """The start-up line, with what the mode means: WARNING when it puts something at risk
    (or a store that requires a synchronous standby has none), INFO otherwise."""
    risky = status.mode in _AT_RISK or (strict and not status.synchronous)
    level = logging.WARNING if risky else logging.INFO
    lc = status.lc_messages
    english = lc is None or lc in ("", "C", "POSIX") or lc.lower().startswith("en")
    logs.emit(
        db_log,
        level,
        "database.replication",
        mode=status.mode,
        meaning=MEANINGS.get(status.mode),
        synchronous_standby_names=status.synchronous_standby_names,
        synchronous_commit=status.synchronous_commit,
        sync_standbys=status.sync_standbys_streaming,
        required=status.required_sync_standbys or None,
        standbys=status.standbys_streaming,
        strict=strict or None,
        # A cancelled synchronous wait is recognised by the server's English text.
        lc_messages=None if english else lc,
    )


def strict_from_env() -> bool:
    """``PAYORCH_REQUIRE_SYNC_STANDBY`` (unset: off). Read here, not through Settings, like
    ``PAYORCH_DB_SCHEMA``: a store must not fail on an unrelated setting."""
    raw = os.environ.get(ENV_STRICT, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigurationError(f"{ENV_STRICT}={raw!r}: use 1 or 0")


_STRICT: weakref.WeakKeyDictionary[Engine, Guard] = weakref.WeakKeyDictionary()


def gate(engine: Engine) -> None:
    """Before a claim on ``engine`` (PostgreSQL's claim statement): refused unless a
    synchronous standby streams, if a strict store runs on it; else nothing, no I/O."""
    guard = _STRICT.get(engine)
    if guard is not None:
        guard.before_claim()


class Guard:
    """A store's replication checks: its engine must give atomic transactions, and with
    ``require_sync_standby`` its claims need a synchronous standby streaming (checked now,
    and before every claim on the engine: :func:`gate`). A store refused at start-up leaves
    no connection open in the engine's pool (the engine stays usable)."""

    def __init__(self, engine: Engine, *, require_sync_standby: bool | None = None) -> None:
        refuse_autocommit(engine)
        self.engine = engine
        self.strict = strict_from_env() if require_sync_standby is None else require_sync_standby
        self._reported = False  # the start-up line is logged once
        if not self.strict:
            return
        # The async API's engine cannot be read outside the bridge: its store checks at
        # its start-up call (AsyncStore.check_replication) and before each claim.
        if not engine.dialect.is_async:
            try:
                self.check()
            except BaseException:
                engine.dispose()
                raise
        _STRICT[engine] = self

    def status(self) -> Status:
        return read_status(self.engine)

    def check(self) -> Status:
        """The start-up check: the status, logged; ``ConfigurationError`` (with the reason)
        when the store requires a synchronous standby and there is none, and
        ``DatabaseReadOnly`` for a standby whatever the setting."""
        status = self.status()
        if status.mode == "read_only":  # a connection adopted before the server was demoted
            raise DatabaseReadOnly("the database is a standby or the session is read-only")
        reason = status.refusal() if self.strict else None
        if reason is not None:  # the error is the one line: no start-up line before it
            raise ConfigurationError(
                f"{ENV_STRICT} is set (claims need a synchronous standby), but {reason}"
            )
        if not self._reported:
            report(status, strict=self.strict)
            self._reported = True
        return status

    def before_claim(self) -> None:
        """In strict mode: no claim unless a synchronous standby streams now."""
        if not self.strict:
            return
        reason = self.status().refusal()
        if reason is not None:
            raise SyncStandbyUnavailable(
                f"no claim without a synchronous standby ({ENV_STRICT}): {reason}; nothing "
                "was claimed, retry with the same key later"
            )
