"""What one fresh operation makes the server write, per arm: rows, index entries, WAL bytes
(and the full-page images among them), WAL records and commits.

Each arm runs single-threaded after a ``CHECKPOINT`` and a warm-up (so full-page images are
those of pages first touched in the measured stretch, not of the whole hot set), between two
readings of the WAL insert position; ``pg_waldump --stats=record`` then counts the records of
that stretch by kind. Rows are heap INSERT records, updates UPDATE (a new tuple and an entry
in every index) or HOT_UPDATE (on the same page, no index entry); index entries are B-tree
leaf insertions (INSERT_LEAF, INSERT_POST and page splits). A commit of a write is a WAL
flush, an ``fsync``, with ``synchronous_commit=on`` and one client. Everything else the server
does in that stretch (autovacuum, the checkpointer) is in the counts too: a few records.

``pg_waldump`` reads the WAL files, so this needs a server on this machine (the throwaway
cluster, or a local one given by URL with its files readable): otherwise it is left out with
one line.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bench_execute as bx
import psycopg
from rich.console import Console
from rich.table import Table

__all__ = ["Amplification", "WalMeter", "print_wal"]

# B-tree records that add a leaf entry (a split inserts the new item as part of its record).
_INDEX_KINDS = ("Btree/INSERT_LEAF", "Btree/INSERT_POST", "Btree/SPLIT_L", "Btree/SPLIT_R")
_ROW = re.compile(r"^(\S+/\S+)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)")


@dataclass(frozen=True, kw_only=True)
class Amplification:
    arm: str
    ops: int
    wal_bytes: float  # per operation, full-page images included
    fpi_bytes: float
    records: float
    rows: float  # heap inserts
    updates: float  # non-HOT updates: a new tuple, an entry in every index
    hot_updates: float
    index_entries: float
    commits: float  # each a WAL flush (fsync) with synchronous_commit=on, one client
    by_kind: dict[str, tuple[float, float]]  # record kind -> (records, bytes) per operation

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _waldump_binary(conn: psycopg.Connection[Any]) -> Path | None:
    row = conn.execute("SHOW server_version_num").fetchone()
    major = int(str(row[0])) // 10000 if row else 0
    for candidate in (Path(f"/usr/lib/postgresql/{major}/bin/pg_waldump"),):
        if candidate.exists():
            return candidate
    found = shutil.which("pg_waldump")
    return Path(found) if found else None


class WalMeter:
    """Measures arms on one server; :attr:`unavailable` says why it cannot, if it cannot."""

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.unavailable: str | None = None
        with psycopg.connect(conninfo, autocommit=True) as conn:
            self.waldump = _waldump_binary(conn)
            try:
                row = conn.execute("SHOW data_directory").fetchone()
            except psycopg.Error as exc:
                self.unavailable = f"WAL per operation: left out ({exc.sqlstate}: no superuser)"
                return
        self.wal_dir = Path(str(row[0] if row else "")) / "pg_wal"
        if self.waldump is None:
            self.unavailable = "WAL per operation: left out (no pg_waldump on this machine)"
        elif not self.wal_dir.is_dir():
            self.unavailable = (
                "WAL per operation: left out (the server's WAL is not on this machine)"
            )

    def _lsn(self) -> str:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        return str(row[0]) if row else "0/0"

    def _stats(self, start: str, end: str) -> dict[str, tuple[int, int, int]]:
        assert self.waldump is not None
        out = subprocess.run(  # noqa: S603 - our own binary, our own LSNs
            [str(self.waldump), "-p", str(self.wal_dir), "-s", start, "-e", end, "--stats=record"],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0 and not out.stdout:
            raise RuntimeError(f"pg_waldump: {out.stderr.strip()[:300]}")
        kinds: dict[str, tuple[int, int, int]] = {}
        for line in out.stdout.splitlines():
            m = _ROW.match(line.strip())
            if m:
                kinds[m.group(1)] = (int(m.group(2)), int(m.group(3)), int(m.group(4)))
        return kinds

    def measure(
        self, name: str, workload: Callable[[str], bx.Factory], *, ops: int, warmup: int = 50
    ) -> Amplification:
        """``ops`` fresh operations of ``workload`` on one thread, after a CHECKPOINT and
        ``warmup`` operations; what the server wrote for them, per operation."""
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            conn.execute("CHECKPOINT")
        tag = bx.new_id()[-8:]
        if warmup:
            bx.run_threads(1, warmup, workload(f"wal-{name}-w-{tag}"))
        start = self._lsn()
        bx.run_threads(1, ops, workload(f"wal-{name}-{tag}"))
        end = self._lsn()
        kinds = self._stats(start, end)

        def count(*names: str) -> float:
            return sum(kinds.get(n, (0, 0, 0))[0] for n in names) / ops

        total = sum(v[1] + v[2] for v in kinds.values())
        fpi = sum(v[2] for v in kinds.values())
        return Amplification(
            arm=name,
            ops=ops,
            wal_bytes=total / ops,
            fpi_bytes=fpi / ops,
            records=sum(v[0] for v in kinds.values()) / ops,
            rows=count("Heap/INSERT", "Heap/INSERT+INIT"),
            updates=count("Heap/UPDATE", "Heap/UPDATE+INIT"),
            hot_updates=count("Heap/HOT_UPDATE", "Heap/HOT_UPDATE+INIT"),
            index_entries=count(*_INDEX_KINDS),
            commits=count("Transaction/COMMIT"),
            by_kind={k: (v[0] / ops, (v[1] + v[2]) / ops) for k, v in sorted(kinds.items())},
        )


def print_wal(console: Console, results: list[Amplification], note: str | None) -> None:
    if note:
        console.print(note)
    if not results:
        return
    floor = next((r for r in results if r.arm == "floor"), None)
    table = Table(
        title="PostgreSQL: what one fresh operation writes (one thread, per operation)",
        title_justify="left",
    )
    for col in (
        "arm",
        "rows",
        "updates (HOT)",
        "index entries",
        "commits",
        "WAL records",
        "WAL bytes",
        "of which FPI",
        "WAL / floor",
    ):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for r in results:
        ratio = f"{r.wal_bytes / floor.wal_bytes:.2f}" if floor and floor.wal_bytes else "-"
        table.add_row(
            r.arm,
            f"{r.rows:.2f}",
            f"{r.updates + r.hot_updates:.2f} ({r.hot_updates:.2f})",
            f"{r.index_entries:.2f}",
            f"{r.commits:.2f}",
            f"{r.records:.1f}",
            f"{r.wal_bytes:,.0f}",
            f"{r.fpi_bytes:,.0f}",
            ratio,
        )
    console.print(table)
    console.print(
        "  From pg_waldump over each arm's stretch of WAL (after a CHECKPOINT and a warm-up). "
        "rows: heap inserts; updates: new tuples (HOT: same page, no index entry); index "
        "entries: B-tree leaf insertions; commits: each a WAL flush (fsync) at one client."
    )
