"""DBOS's "workflow + step" on the same PostgreSQL: the issue's other point of comparison.

Per operation: a DBOS workflow whose id is the operation's namespace (DBOS's idempotency
key, ``SetWorkflowID``) runs one step that calls the same in-process instant provider as
``execute()`` and returns its answer. DBOS keeps its system database on the benchmark's
server: it creates it at launch (``DBOS(config=…)``, ``DBOS.launch()``), and it is dropped
after ``DBOS.destroy()``. ``dbos`` is optional (the ``bench`` extra): without it the arm is
left out and the report says so in one line.
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Callable
from typing import Any

import bench_db
import bench_execute as bx
import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from payorch.provider import AnswerKind, SubmitRequest

__all__ = ["NOT_INSTALLED", "DbosBench", "available"]

NOT_INSTALLED = "DBOS: not installed (pip install '.[bench]')"


def available() -> bool:
    return importlib.util.find_spec("dbos") is not None


class DbosBench:
    """One DBOS instance (a process-wide singleton) on a system database of its own."""

    def __init__(self, server: bench_db.Server, provider: bx.InstantProvider) -> None:
        from dbos import DBOS, DBOSConfig, SetWorkflowID

        self._admin = bench_db.conninfo_of(server.url)
        self.database = f"payorch_bench_dbos_{uuid.uuid4().hex[:8]}"
        system_url = (
            make_url(server.url)
            .set(drivername="postgresql", database=self.database)
            .render_as_string(hide_password=False)
        )
        self._set_id = SetWorkflowID

        # Registered before DBOS() is built, as DBOS wants; names keep them apart from any
        # other registration in the process.
        @DBOS.step(name="payorch_bench_submit")
        def submit(tenant: str, key: str, operation_id: str) -> dict[str, Any]:
            answer = provider.submit(
                SubmitRequest(
                    tenant_id=tenant,
                    operation=bx.OPERATION,
                    operation_id=operation_id,
                    downstream_key=f"dbos:{operation_id}:submit",
                    payload=bx.REQUEST,
                    idempotency_key=key,
                )
            )
            return {"kind": answer.kind.value, "provider_reference": answer.provider_reference}

        @DBOS.workflow(name="payorch_bench_payment")
        def payment(tenant: str, key: str, request: dict[str, Any]) -> dict[str, Any]:
            return submit(tenant, key, DBOS.workflow_id or "")

        self._workflow: Callable[[str, str, dict[str, Any]], dict[str, Any]] = payment
        self._dbos = DBOS
        # log_level: DBOS logs at INFO on launch and shutdown; the report is the output.
        config: DBOSConfig = {
            "name": "payorch-bench",
            "system_database_url": system_url,
            "log_level": "WARNING",
        }
        DBOS(config=config)
        try:
            DBOS.launch()
        except BaseException:
            self.close()
            raise

    def workload(self, tenant: str) -> Callable[[str], bx.Factory]:
        """Fresh keys: one workflow per operation, its id the namespace; one step."""
        succeeded = AnswerKind.SUCCEEDED.value

        def factory_for(prefix: str) -> bx.Factory:
            def factory(t: int) -> bx.Worker:
                def op(i: int) -> bool:
                    k = bx.key(prefix, t, i)
                    with self._set_id(f"{tenant}:{bx.OPERATION}:{k}"):
                        out = self._workflow(tenant, k, dict(bx.REQUEST))
                    return out.get("kind") == succeeded

                return bx.Worker(op)

            return factory

        return factory_for

    def close(self) -> None:
        """Shut DBOS down, then drop its system database (whatever is still connected)."""
        try:
            self._dbos.destroy(destroy_registry=True)
        finally:
            with psycopg.connect(self._admin, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(self.database)
                    )
                )
