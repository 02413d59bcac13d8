"""A throwaway redis-server for the tests, on 127.0.0.1 and a free port.

Started from the installed binary (Debian's ``redis-server``), with no persistence
(``--save ''``, no AOF) and its working directory in a temporary directory, so nothing
outlives the run. Without the binary the Redis tests skip, and the run ends with one
summary line naming the missing server (``make test`` as root installs it with apt-get, as
``.ci/run`` does); even with ``PAYORCH_REQUIRE_POSTGRES=1`` a missing binary is that skip.
A binary that is there but does not start fails with ``PAYORCH_REQUIRE_POSTGRES=1``.

Under pytest-xdist every worker starts its own server (a session fixture runs per worker),
on a port of its own, so a test's ``flushall`` never empties another worker's streams.

Fixtures: ``redis_server`` (one server for the session) and ``redis_url`` (its URL,
emptied for each test); ``fresh_redis_server`` for a test that stops its own.
Register with ``pytest_plugins = ["redis_server"]`` or import the fixtures.
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
from ports import free_port, start_on_a_free_port

__all__ = [
    "SKIP_PREFIX",
    "RedisMissing",
    "RedisServer",
    "RedisUnavailable",
    "fresh_redis_server",
    "redis_server",
    "redis_url",
    "start_or_skip",
]

_READY_WITHIN = 30.0  # seconds for the server to answer PING
REQUIRE = os.environ.get("PAYORCH_REQUIRE_POSTGRES") == "1"


class RedisUnavailable(Exception):
    pass


class RedisMissing(RedisUnavailable):
    """No redis-server binary on this machine: a skip, never a failure."""


# The skip reason's first words: conftest.py's run summary counts the skips by it.
SKIP_PREFIX = "redis-server unavailable"


def _binary() -> str:
    for found in (shutil.which("redis-server"), "/usr/bin/redis-server"):
        if found and os.access(found, os.X_OK):
            return found
    raise RedisMissing("no redis-server binary (Debian package `redis-server`)")


def _ping(port: int) -> bool:
    """One PING over a raw socket (RESP inline command): no client library needed."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process; :meth:`url` gives a database on it."""

    def __init__(self) -> None:
        self.binary = _binary()
        self.root = Path(tempfile.mkdtemp(prefix="payorch-redis-"))
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    @property
    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.root / "redis.log").read_text(errors="replace")
        return ""

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        self.port = start_on_a_free_port(
            self._start_on,
            self.port,
            unavailable=RedisUnavailable,
            taken=lambda exc, _attempt: "already in use" in str(exc),
        )

    def _start_on(self, port: int) -> None:
        self.port = port
        self._start_once()

    def _start_once(self) -> None:
        (self.root / "redis.log").unlink(missing_ok=True)  # a failed try's
        self._proc = subprocess.Popen(
            [
                self.binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                str(self.root),
                "--logfile",
                str(self.root / "redis.log"),
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--protected-mode",
                "yes",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.root,
        )
        self._await_ping()

    def _await_ping(self) -> None:
        deadline = time.monotonic() + _READY_WITHIN
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RedisUnavailable(f"redis-server exited: {self.log.strip()[-2000:]}")
            # Its own log line first: a port that answers may be another process's.
            if "Ready to accept connections" in self.log and _ping(self.port):
                return
            # The log and the PING are the signal; waiting on the process only paces the
            # polling (and notices an early exit at once).
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=0.05)
        self.stop()
        raise RedisUnavailable(f"redis-server did not answer PING within {_READY_WITHIN} s")

    def stop(self, *, keep_files: bool = False) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()  # SIGTERM: with no persistence configured it exits at once
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if not keep_files:
            shutil.rmtree(self.root, ignore_errors=True)


def start_or_skip() -> RedisServer:
    """A started server, or skip: a missing binary always skips; a server that does not
    start fails when ``PAYORCH_REQUIRE_POSTGRES=1``."""
    try:
        server = RedisServer()
        server.start()
    except RedisUnavailable as exc:
        if REQUIRE and not isinstance(exc, RedisMissing):
            pytest.fail(f"redis-server (PAYORCH_REQUIRE_POSTGRES=1) did not start: {exc}")
        pytest.skip(f"{SKIP_PREFIX}: {exc}")
    return server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = start_or_skip()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's server, emptied first: a test's keys and streams never meet another's
    (the tests of one worker run one at a time, and each worker has its own server)."""
    import redis

    url = redis_server.url()
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        client.flushall()
    finally:
        client.close()
    return url


@pytest.fixture
def fresh_redis_server() -> Iterator[RedisServer]:
    """A server of the test's own, which it may stop."""
    server = start_or_skip()
    try:
        yield server
    finally:
        server.stop()
