"""execute() through a Citus coordinator (two workers, payorch's tables distributed by tenant,
32 shards per table) beside the same on a single node, interleaved in one run, at 1 and 8
threads; every node keeps the server's default durability (fsync on). Runs only where the
server's library directory holds Citus (built by hand: the distribution does not package
it); otherwise the report says why it did not run.

Each operation's tenant is one of 64, so the writes spread over the shards (and so over
both workers) as a multi-tenant service's do. On loopback the coordinator adds a hop to
every statement: the figures show that cost, not a gain; a cluster's gain is capacity
(disks, CPUs and memory of N workers), which one machine cannot show.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_db
import bench_execute as bx
from figures import Options, Report
from rich.console import Console

from payorch import Executor, Store, migrate
from payorch.core import State

REPO = Path(__file__).resolve().parent.parent
TENANTS = 64
SHARDS = 32
Say = Callable[[str], None]


def spread_workload(executor: Executor, prefix_tenant: str) -> Callable[[str], bx.Factory]:
    """Fresh keys, each operation's tenant one of :data:`TENANTS`."""

    def factory_for(prefix: str) -> bx.Factory:
        def factory(t: int) -> bx.Worker:
            def op(i: int) -> bool:
                out = executor.execute(
                    tenant_id=f"{prefix_tenant}-{(t * 7919 + i) % TENANTS}",
                    operation=bx.OPERATION,
                    idempotency_key=bx.key(prefix, t, i),
                    request=bx.REQUEST,
                )
                return out.state is State.SUCCEEDED and not out.replayed

            return bx.Worker(op)

        return factory

    return factory_for


def bench_citus(
    server: bench_db.Server,
    opts: Options,
    report: Report,
    say: Say,
    make_executor: Callable[[Store, str], Executor],
) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    import citus  # the test suite's cluster

    if not citus.extension_present():
        report.extra["citus"] = "Citus: skipped (no citus.so in the server's library directory)"
        return
    say("starting a Citus cluster (a coordinator, two workers; durable) beside the single node")
    cluster = citus.CitusCluster(durable=True, shard_count=SHARDS)
    stores: list[Store] = []
    try:
        url = cluster.start()
        migrate.upgrade(url)
        migrate.distribute(url)
        with bench_db.fresh_database(server, "payorch_bench_single") as single:
            stores = [Store.from_url(single.url), Store.from_url(url)]
            arms = [
                bx.Arm(name="single", fresh=spread_workload(make_executor(stores[0], "s"), "t")),
                bx.Arm(name="citus", fresh=spread_workload(make_executor(stores[1], "c"), "t")),
            ]
            figures: dict[str, Any] = {}
            for n in opts.threads:
                say(f"Citus, {n} thread(s): execute() single node vs through the coordinator")
                comparison = bx.interleave(
                    arms,
                    threads=n,
                    total=opts.pg_ops(n),
                    replays=0,
                    rounds=opts.rounds,
                    warmup=opts.warmup,
                )
                report.add("citus", n, comparison)
                one, dist = comparison.merged["single"], comparison.merged["citus"]
                figures[str(n)] = {
                    "single_ops_s": round(one.ops_per_s, 1),
                    "citus_ops_s": round(dist.ops_per_s, 1),
                    "ratio": round(dist.ops_per_s / one.ops_per_s, 2) if one.ops_per_s else None,
                }
            report.extra["citus"] = figures
    except citus.CitusUnavailable as exc:
        report.extra["citus"] = f"Citus: could not start ({exc})"
    finally:
        for store in stores:
            store.close()
        cluster.stop()


def print_citus(console: Console, report: Report) -> None:
    found = report.extra.get("citus")
    if not isinstance(found, dict):
        if found:
            console.print(str(found), highlight=False, markup=False)
        return
    console.print(
        f"Citus (coordinator + 2 workers, {SHARDS} shards/table, {TENANTS} tenants, fsync on): "
        "execute() ops/s, single node vs through the coordinator, same run"
    )
    for n, f in found.items():
        console.print(
            f"  {n:>2} thread(s): single {f['single_ops_s']:>8.1f}   citus "
            f"{f['citus_ops_s']:>8.1f}   citus/single {f['ratio']}",
            highlight=False,
        )
