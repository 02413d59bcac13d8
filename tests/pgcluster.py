"""A throwaway PostgreSQL cluster for the test run, started from the installed binaries.

As root, initdb refuses to run; the server then runs as the ``postgres`` (or ``nobody``)
user. ``fsync=off`` by default (and initdb without its final sync): the cluster lives for one
test run and is deleted after it. Each cluster has its own data directory and port, so test
processes running side by side (pytest-xdist workers, one cluster each) never meet.
``Cluster(durable=True)`` keeps the server's default durability (fsync, synchronous_commit and
full_page_writes untouched), for benchmarks whose commits should cost what they cost.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from ports import free_port, start_on_a_free_port


class ClusterUnavailable(Exception):
    pass


def _bind_failed(log: Path) -> bool:
    """The server's log says its port was taken."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return False
    return "could not bind" in text or "Address already in use" in text


def _bindir() -> Path:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for c in candidates:
        if (Path(c) / "initdb").exists():
            return Path(c)
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    raise ClusterUnavailable("no PostgreSQL server binaries (initdb) found")


def _demote() -> tuple[Callable[[], None] | None, int | None, int | None]:
    if os.geteuid() != 0:
        return None, None, None
    for name in ("postgres", "nobody"):
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        uid, gid = pw.pw_uid, pw.pw_gid

        def _preexec(uid: int = uid, gid: int = gid) -> None:
            os.setgid(gid)
            os.setuid(uid)

        return _preexec, uid, gid
    raise ClusterUnavailable("running as root and no unprivileged user to run PostgreSQL")


class Cluster:
    def __init__(self, *, durable: bool = False, settings: dict[str, str] | None = None) -> None:
        self.durable = durable
        self.settings = dict(settings or {})  # more server settings (-c name=value)
        self.bindir = _bindir()
        self.root = Path(tempfile.mkdtemp(prefix="payorch-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.preexec, uid, gid = _demote()
        if uid is not None and gid is not None:
            os.chown(self.root, uid, gid)
        self.env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        if uid is not None:  # the server's own home: not root's (libpq reads ~/.postgresql)
            self.env["HOME"] = str(self.root)

    def _run(self, *args: str) -> None:
        proc = subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            preexec_fn=self.preexec,
            env=self.env,
            capture_output=True,
            text=True,
            cwd=self.root,
        )
        if proc.returncode != 0:
            raise ClusterUnavailable(f"{args[0]} failed: {proc.stderr.strip() or proc.stdout}")

    def start(self) -> str:
        initdb = ["initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8"]
        self._run(*initdb, *([] if self.durable else ["--no-sync"]))
        logs: list[Path] = []

        def start_once(port: int) -> None:
            opts = f"-p {port} -k {self.root} -c listen_addresses=127.0.0.1"
            opts += " -c max_connections=300"
            opts += "".join(f" -c {name}={value}" for name, value in self.settings.items())
            if not self.durable:
                opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
            log = self.root / f"log.{len(logs)}" if logs else self.root / "log"
            logs.append(log)
            self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(log), "-w", "start")

        self.port = start_on_a_free_port(
            start_once,
            self.port,
            unavailable=ClusterUnavailable,
            taken=lambda _exc, attempt: _bind_failed(logs[attempt]),
        )
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        with contextlib.suppress(ClusterUnavailable):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
