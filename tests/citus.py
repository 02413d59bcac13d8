"""A throwaway Citus cluster on loopback: a coordinator and two workers, for the tests that
run payorch on tables distributed by tenant (``payorch db distribute``).

``PAYORCH_TEST_CITUS_URL`` names a coordinator to use instead (a database where the
``citus`` extension exists and workers are added). Otherwise the cluster is started here
when the server's library directory holds the extension (``citus.so``); without either,
the tests that need it are left out and the run ends with one loud line (``CITUS TESTS DID
NOT RUN``), in CI too: Citus is not packaged by the distribution, so CI runs without it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import sqlalchemy as sa
from pgcluster import Cluster, ClusterUnavailable, _bindir

SKIP_PREFIX = "Citus unavailable"
WORKERS = 2
# Fewer shards than Citus's default (32) keep the per-test cleanup quick; the statements
# are the same whatever the count.
SHARD_COUNT = 4


class CitusUnavailable(Exception):
    pass


def extension_present() -> bool:
    """The server's library directory holds Citus."""
    try:
        return (_bindir().parent / "lib" / "citus.so").exists()
    except ClusterUnavailable:
        return False


def _dsn(url: str) -> str:
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class CitusCluster:
    """Three servers (a coordinator, two workers) with ``citus`` preloaded; the extension
    created on each and the workers added to the coordinator."""

    def __init__(self, *, durable: bool = False, shard_count: int = SHARD_COUNT) -> None:
        settings = {"shared_preload_libraries": "citus", "citus.shard_count": str(shard_count)}
        self.nodes = [Cluster(durable=durable, settings=settings) for _ in range(WORKERS + 1)]

    def start(self) -> str:
        urls: list[str] = []
        try:
            for node in self.nodes:
                urls.append(node.start())
            for url in urls:
                with psycopg.connect(_dsn(url), autocommit=True) as conn:
                    conn.execute("CREATE EXTENSION IF NOT EXISTS citus")
            coordinator = self.nodes[0]
            with psycopg.connect(_dsn(urls[0]), autocommit=True) as conn:
                conn.execute(
                    "SELECT citus_set_coordinator_host('127.0.0.1', %s)", (coordinator.port,)
                )
                for worker in self.nodes[1:]:
                    conn.execute("SELECT citus_add_node('127.0.0.1', %s)", (worker.port,))
        except (ClusterUnavailable, psycopg.Error) as exc:
            self.stop()
            raise CitusUnavailable(f"the Citus cluster did not start: {exc}") from None
        return urls[0]

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()


@contextlib.contextmanager
def exclusive(url: str) -> Iterator[None]:
    """Hold the coordinator alone while a test uses it, when it is one given by
    ``PAYORCH_TEST_CITUS_URL``: every test process (pytest-xdist's workers) shares it and each
    test empties its tables. A cluster started here is the process's own: no lock."""
    if os.environ.get("PAYORCH_TEST_CITUS_URL") != url:
        yield
        return
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"payorch-citus-{digest}.lock"
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def missing_reason() -> str | None:
    """Why no Citus can be had here (None: a coordinator is given, or can be started)."""
    if os.environ.get("PAYORCH_TEST_CITUS_URL") or extension_present():
        return None
    return "no Citus extension in the server's library directory and no PAYORCH_TEST_CITUS_URL"


def coordinator_url() -> tuple[str, CitusCluster | None]:
    """A coordinator's URL, and the cluster started for it (None for one given)."""
    given = os.environ.get("PAYORCH_TEST_CITUS_URL")
    if given:
        return given, None
    if not extension_present():
        raise CitusUnavailable(
            "no Citus extension in the server's library directory and no PAYORCH_TEST_CITUS_URL"
        )
    cluster = CitusCluster()
    return cluster.start(), cluster


__all__ = [
    "SKIP_PREFIX",
    "CitusCluster",
    "CitusUnavailable",
    "coordinator_url",
    "exclusive",
    "missing_reason",
]
