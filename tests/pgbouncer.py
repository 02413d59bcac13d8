"""A throwaway PgBouncer in transaction pooling mode, in front of the test run's PostgreSQL.

Started from the installed binary (Debian's ``pgbouncer``), on 127.0.0.1 and a free port,
with its ini and user list in a temporary directory. As root it runs as the ``postgres``
(or ``nobody``) user, as the test cluster does: PgBouncer refuses to run as root.

Its pools are small and handed out round-robin, so consecutive transactions of one client
connection land on different server connections: whatever relies on session state (a
prepared statement, a ``SET``, a LISTEN) breaks here rather than by luck in production.

Without the binary the pooler tests skip, and the run ends with one summary line naming the
missing server (``make test`` as root installs it with apt-get, as ``.ci/run`` does); even
with ``PAYORCH_REQUIRE_POSTGRES=1`` a missing binary is that skip. A binary that is there but
does not start fails with ``PAYORCH_REQUIRE_POSTGRES=1``. Under pytest-xdist every worker
starts its own, in front of its own cluster.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from pgcluster import _demote
from ports import free_port, start_on_a_free_port

__all__ = ["SKIP_PREFIX", "PgBouncer", "PgBouncerMissing", "PgBouncerUnavailable", "start_or_skip"]

_READY_WITHIN = 30.0  # seconds for the port to accept connections
REQUIRE = os.environ.get("PAYORCH_REQUIRE_POSTGRES") == "1"
# The skip reason's first words: conftest.py's run summary counts the skips by it.
SKIP_PREFIX = "PgBouncer unavailable"


class PgBouncerUnavailable(Exception):
    pass


class PgBouncerMissing(PgBouncerUnavailable):
    """No pgbouncer binary on this machine: a skip, never a failure."""


def _binary() -> str:
    for found in (shutil.which("pgbouncer"), "/usr/sbin/pgbouncer"):
        if found and os.access(found, os.X_OK):
            return found
    raise PgBouncerMissing("no pgbouncer binary (Debian package `pgbouncer`)")


def _quote(value: str) -> str:
    """A user list entry's quoting."""
    return '"' + value.replace('"', '""') + '"'


def _conninfo(value: str) -> str:
    """A libpq-style connection string value, quoted."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class PgBouncer:
    """``pool_mode = transaction`` in front of the server at ``server_url``."""

    def __init__(self, server_url: str, *, pool_size: int = 4) -> None:
        self.binary = _binary()
        self.server = sa.make_url(server_url)
        self.pool_size = pool_size
        self.root = Path(tempfile.mkdtemp(prefix="payorch-pgbouncer-"))
        self.port = free_port()
        self.preexec, uid, gid = _demote()
        if uid is not None and gid is not None:
            os.chown(self.root, uid, gid)
        self._proc: subprocess.Popen[bytes] | None = None

    def url(self, db_url: str) -> str:
        """``db_url`` (a database on the server) as reached through the pooler."""
        parsed = sa.make_url(db_url).set(host="127.0.0.1", port=self.port)
        return parsed.render_as_string(hide_password=False)

    def warm(self, db_url: str) -> None:
        """Open every server connection of ``db_url``'s pool now (transactions held at
        once), so that from here on consecutive transactions go round the pool."""
        import psycopg

        dsn = sa.make_url(self.url(db_url)).set(drivername="postgresql")
        conns = [
            psycopg.connect(dsn.render_as_string(hide_password=False), connect_timeout=10)
            for _ in range(self.pool_size)
        ]
        try:
            for conn in conns:
                conn.execute("SELECT 1")  # a transaction left open: it holds its server
        finally:
            for conn in conns:
                conn.close()

    @property
    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.root / "pgbouncer.log").read_text(errors="replace")
        return ""

    def start(self) -> None:
        self.port = start_on_a_free_port(
            self._start_on,
            self.port,
            unavailable=PgBouncerUnavailable,
            taken=lambda exc, _attempt: "already in use" in str(exc),
        )

    def _start_on(self, port: int) -> None:
        self.port = port
        self._start_once()

    def _start_once(self) -> None:
        user = self.server.username or "postgres"
        # Every database name maps to the same one on the server: tests make their own.
        target = f"host={self.server.host or '127.0.0.1'} port={self.server.port or 5432}"
        target += f" user={_conninfo(user)}"
        if self.server.password:
            target += f" password={_conninfo(self.server.password)}"
        ini = f"""\
[databases]
* = {target}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.root / "userlist.txt"}
logfile = {self.root / "pgbouncer.log"}
pidfile = {self.root / "pgbouncer.pid"}
pool_mode = transaction
default_pool_size = {self.pool_size}
min_pool_size = {self.pool_size}
reserve_pool_size = 0
server_round_robin = 1
max_client_conn = 1000
; A pool exhausted by a stuck transaction fails its queued clients instead of hanging.
query_wait_timeout = 60
server_login_retry = 1
"""
        (self.root / "pgbouncer.ini").write_text(ini)
        (self.root / "userlist.txt").write_text(f'{_quote(user)} ""\n')
        for name in ("pgbouncer.ini", "userlist.txt"):
            (self.root / name).chmod(0o644)
        (self.root / "pgbouncer.log").unlink(missing_ok=True)  # a failed try's
        self._proc = subprocess.Popen(
            [self.binary, str(self.root / "pgbouncer.ini")],
            preexec_fn=self.preexec,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.root,
        )
        self._await_port()

    def _await_port(self) -> None:
        deadline = time.monotonic() + _READY_WITHIN
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise PgBouncerUnavailable(f"pgbouncer exited: {self.log.strip()[-2000:]}")
            # Its own log line first: a port that accepts may be another process's.
            if f"listening on 127.0.0.1:{self.port}" in self.log:
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", self.port), timeout=1),
                ):
                    return
            # The log and the port are the signal; waiting on the process only paces the
            # polling (and notices an early exit at once).
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=0.05)
        self.stop()
        raise PgBouncerUnavailable(f"pgbouncer did not listen within {_READY_WITHIN} s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()  # SIGTERM: immediate shutdown, clients cut
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


def start_or_skip(server_url: str) -> Iterator[PgBouncer]:
    """A started PgBouncer in front of ``server_url`` for a fixture to yield, stopped after;
    or skip: a missing binary always skips, one that does not start fails when
    ``PAYORCH_REQUIRE_POSTGRES=1``."""
    try:
        bouncer = PgBouncer(server_url)
        bouncer.start()
    except PgBouncerUnavailable as exc:
        if REQUIRE and not isinstance(exc, PgBouncerMissing):
            pytest.fail(f"PgBouncer (PAYORCH_REQUIRE_POSTGRES=1) did not start: {exc}")
        pytest.skip(f"{SKIP_PREFIX}: {exc}")
    try:
        yield bouncer
    finally:
        bouncer.stop()
