"""`payorch demo` as a user runs it: a real subprocess, exit 0, zero duplicates, and
what was flagged for a human, and why."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from payorch.cli._demo import attention_reasons
from payorch.execution._executor import Executor
from payorch.records import OperationRecord
from payorch.storage._store import Store

PAYORCH = Path(sys.executable).parent / "payorch"


@pytest.mark.slow
def test_demo_exits_zero_with_no_duplicates(db_url: str) -> None:
    args = [str(PAYORCH), "demo", "--payments", "120", "--seed", "3"]
    if db_url.startswith("postgresql"):
        args += ["--database-url", db_url]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "duplicates: 0" in proc.stdout
    assert "invariants hold" in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_demo_reports_flags_and_why(db_url: str) -> None:
    # The same report, without the load: a short run still prints the flagged count.
    args = [str(PAYORCH), "demo", "--payments", "20", "--seed", "5"]
    if db_url.startswith("postgresql"):
        args += ["--database-url", db_url]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "duplicates: 0" in proc.stdout
    assert re.search(r"needs_attention: \d+ operations flagged", proc.stdout), proc.stdout


def test_attention_reasons_group_flagged_operations_by_why(
    executor: Executor, store: Store
) -> None:
    def pay(key: str) -> OperationRecord:
        outcome = executor.execute(
            tenant_id="t1",
            operation="payment.create",
            idempotency_key=key,
            request={"amount": 100, "currency": "EUR"},
        )
        return store.get("t1", outcome.operation_id)

    executor.execute(  # a clean one: never counted
        tenant_id="t1",
        operation="payment.create",
        idempotency_key="clean",
        request={"amount": 100, "currency": "EUR"},
    )
    for key in ("conflict-1", "conflict-2"):
        store.flag_attention(pay(key), kind="conflicting_evidence", actor="test", detail={})
    store.flag_attention(pay("plain"), kind="operator_note", actor="test", detail={})
    with store.engine.connect() as conn:
        reasons = attention_reasons(conn, "t1")
        assert attention_reasons(conn, "other-tenant") == Counter()
    assert reasons == Counter({"conflicting_evidence [succeeded]": 2, "no reason [succeeded]": 1})
