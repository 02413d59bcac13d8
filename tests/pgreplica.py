"""A PostgreSQL primary and a streaming standby on loopback, for failover tests.

Built on :mod:`pgcluster` (its binaries and its demotion to an unprivileged user): the
primary is a :class:`~pgcluster.Cluster` started with replication-friendly settings, the
standby a ``pg_basebackup -R`` of it (so whatever the primary holds at that moment, a
migrated schema included, is on the standby too). What a test does to them is what an
operator or a crash does: stop the standby (its stream is cut), ``kill -9`` the primary's
postmaster and every backend, promote the standby.

Every wait here polls a condition against a deadline; nothing sleeps for a fixed time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
from pgcluster import Cluster, ClusterUnavailable
from ports import free_port

__all__ = ["ReplicaPair", "poll", "url_for"]

DEADLINE = 60.0  # seconds any one wait may take before the test fails
STANDBY_NAME = "payorch_standby"  # the standby's application_name, for synchronous_standby_names


def poll(what: str, check: Callable[[], bool], *, deadline: float = DEADLINE) -> None:
    """Until ``check()`` holds, at most ``deadline`` seconds; then fail saying ``what``."""
    until = time.monotonic() + deadline
    pause = 0.01
    while not check():
        if time.monotonic() > until:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(pause)  # a poll interval, not a synchronisation: the check decides
        pause = min(pause * 2, 0.2)


def url_for(port: int) -> str:
    return f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


class ReplicaPair:
    """A primary and one streaming standby.

    ``synchronous=True`` names the standby in the primary's ``synchronous_standby_names``
    (commits wait for it) once it streams; otherwise replication is asynchronous.
    """

    def __init__(self, *, synchronous: bool = False) -> None:
        self.primary = Cluster()
        self.synchronous = synchronous
        self.standby_data = self.primary.root / "standby"
        self.standby_port = free_port()
        self.standby_started = False
        self.primary_alive = False

    # -- set-up ---------------------------------------------------------------------------

    @property
    def primary_port(self) -> int:
        return self.primary.port

    @property
    def primary_url(self) -> str:
        return url_for(self.primary.port)

    @property
    def standby_url(self) -> str:
        return url_for(self.standby_port)

    def multi_host_url(self) -> str:
        """Both servers, the standby first: libpq skips whichever is not read-write."""
        return (
            "postgresql+psycopg://postgres@/postgres"
            f"?host=127.0.0.1:{self.standby_port}&host=127.0.0.1:{self.primary.port}"
            "&target_session_attrs=read-write"
        )

    def start_primary(self) -> str:
        """initdb and start the primary (not yet replicated); its URL."""
        c = self.primary
        c._run("initdb", "-D", str(c.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        self._append(
            c.data,
            # A throwaway cluster: no fsync; but commits are synchronous, so that a
            # synchronous standby is waited for.
            "fsync = off",
            "full_page_writes = off",
            "synchronous_commit = on",
            "wal_level = replica",
            "max_wal_senders = 5",
            "max_connections = 100",
            "wal_sender_timeout = 5s",
        )
        self._ctl("start", c.data, c.port)
        self.primary_alive = True
        return self.primary_url

    def start_standby(self) -> str:
        """A base backup of the primary as it is now, started streaming; its URL."""
        c = self.primary
        c._run(
            "pg_basebackup",
            "-D", str(self.standby_data),
            "-h", "127.0.0.1", "-p", str(c.port), "-U", "postgres",
            "-X", "stream", "-R", "--checkpoint=fast",
        )  # fmt: skip
        # -R wrote primary_conninfo; the application name makes it a named standby.
        self._append(
            self.standby_data,
            # The primary's settings came with the backup: once promoted, the standby waits
            # for no standby of its own (it has none).
            "synchronous_standby_names = ''",
            f"cluster_name = '{STANDBY_NAME}'",
            "wal_receiver_status_interval = 1s",
            "wal_retrieve_retry_interval = 200ms",
        )
        auto = self.standby_data / "postgresql.auto.conf"
        text = auto.read_text()
        auto.write_text(
            text.replace(
                "primary_conninfo = '", f"primary_conninfo = 'application_name={STANDBY_NAME} "
            )
        )
        self.restart_standby()
        poll("the standby to stream", lambda: self._streaming(sync=False))
        if self.synchronous:
            # Only now: until the standby streams, every commit (a migration's too) would wait.
            self.execute(
                self.primary.port,
                f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'",
            )
            self.scalar(self.primary.port, "SELECT pg_reload_conf()")
            self.wait_streaming()
        return self.standby_url

    def _append(self, data: Path, *lines: str) -> None:
        with (data / "postgresql.conf").open("a") as conf:
            conf.write("\n".join(line for line in lines if line) + "\n")

    def _ctl(self, action: str, data: Path, port: int) -> None:
        c = self.primary
        opts = f"-p {port} -k {c.root} -c listen_addresses=127.0.0.1"
        log = str(data.parent / f"{data.name}.log")
        c._run("pg_ctl", "-D", str(data), "-o", opts, "-l", log, "-w", "-t", "60", action)

    # -- what tests do to them ------------------------------------------------------------

    def scalar(self, port: int, sql: str) -> object:
        """One value read on the server at ``port`` (autocommit: it never waits for a standby)."""
        return self.execute(port, sql, rows=True)

    def execute(self, port: int, sql: str, *, rows: bool = False) -> object:
        engine = sa.create_engine(
            url_for(port), isolation_level="AUTOCOMMIT", poolclass=sa.NullPool
        )
        try:
            with engine.connect() as conn:
                result = conn.exec_driver_sql(sql)
                return result.scalar() if rows else None
        finally:
            engine.dispose()

    def _streaming(self, *, sync: bool) -> bool:
        sql = "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
        if sync:
            sql += " AND sync_state = 'sync'"
        return bool(self.scalar(self.primary.port, sql))

    def wait_streaming(self) -> None:
        """Until the standby streams (synchronously, for a synchronous pair)."""
        poll("the standby to stream", lambda: self._streaming(sync=self.synchronous))

    def stop_standby(self) -> None:
        """The standby shuts down: its stream is cut, what the primary commits stays there."""
        self._ctl("stop", self.standby_data, self.standby_port)
        self.standby_started = False
        poll(
            "the primary to see its standby gone",
            lambda: not self.scalar(self.primary.port, "SELECT count(*) FROM pg_stat_replication"),
        )

    def restart_standby(self) -> None:
        self._ctl("start", self.standby_data, self.standby_port)
        self.standby_started = True

    def kill_primary(self) -> None:
        """``kill -9`` the primary's postmaster and every process it started, as a host
        crash would: nothing is flushed, no backend answers another statement."""
        pidfile = self.primary.data / "postmaster.pid"
        postmaster = int(pidfile.read_text().split()[0])
        victims = [postmaster, *_children(postmaster)]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.primary_alive = False
        poll("the primary's processes to die", lambda: not any(_alive(p) for p in victims))
        poll("the primary's port to close", lambda: not _accepts(self.primary.port))

    def promote(self) -> None:
        """The standby becomes the primary (``pg_ctl promote`` waits for it)."""
        c = self.primary
        c._run("pg_ctl", "-D", str(self.standby_data), "-w", "-t", "60", "promote")
        poll(
            "the promoted standby to accept writes",
            lambda: self.scalar(self.standby_port, "SELECT NOT pg_is_in_recovery()") is True,
        )

    def stop(self) -> None:
        if self.standby_started:
            with contextlib.suppress(ClusterUnavailable):
                self.primary._run("pg_ctl", "-D", str(self.standby_data), "-m", "immediate", "stop")
        if self.primary_alive:
            self.primary.stop()  # also removes the whole tree, the standby's data included
        else:
            import shutil

            shutil.rmtree(self.primary.root, ignore_errors=True)


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            # The parent pid is the 4th field, after "(comm)", which may hold spaces.
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, just not reaped
