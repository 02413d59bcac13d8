"""``payorch recon`` (issue 37): import, report and adopt from the command line, against the
sandbox's own settlement report of a day with faults; bad files refused in one line each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import run
from unexplained_helpers import TENANT, lose, make_executor, pay

from payorch.core import State
from payorch.execution._executor import Executor
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.providers.sandbox._faults import Fault
from payorch.storage._store import Store

pytestmark = pytest.mark.usefixtures("no_key_scope")


@pytest.fixture
def executor(store: Store, sandbox_provider: SandboxProvider) -> Executor:
    return make_executor(store, sandbox_provider)


def test_import_report_and_adopt_an_orphan(
    store: Store, db_url: str, executor: Executor, sandbox: SandboxServer, tmp_path: Path
) -> None:
    sandbox.inject(Fault.DROP_AFTER)
    unknown = pay(executor, "order-1")
    lost = pay(executor, "order-2")
    lose(store, lost.operation_id)
    path = tmp_path / "payout.csv"
    path.write_bytes(sandbox.settlement_report(fee=lambda amount: amount // 100))
    effects = len(sandbox.ledger())

    imported = run(db_url, "recon", "import", "--provider", "sandbox", str(path), "--json")
    assert imported.exit_code == 0, imported.output
    (result,) = json.loads(imported.stdout)["imports"]
    assert result["counts"] == {"settles_unknown": 1, "orphan": 1, "other": 1}
    assert [b["status"] for b in result["batches"]] == ["balanced"]
    assert store.get(TENANT, unknown.operation_id).state is State.SUCCEEDED

    shown = run(db_url, "recon", "report", "--json")
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.stdout)
    (orphan,) = [r for r in report["listed"] if r["class"] == "orphan"]
    assert orphan["adoptable"] and orphan["reference"] == lost.provider_reference
    scoped = run(db_url, "recon", "report", "--file", result["digest"][:12], "--json")
    assert scoped.exit_code == 0, scoped.output
    one = json.loads(scoped.stdout)
    assert [f["digest"] for f in one["files"]] == [result["digest"]]
    assert [b["status"] for b in one["batches"]] == ["balanced"]
    text = run(db_url, "recon", "report")
    assert text.exit_code == 0 and "balanced" in text.stdout and "adoptable" in text.stdout

    adopt = ["recon", "adopt", orphan["row"], "--provider", "sandbox"]
    adopted = run(db_url, *adopt, "--actor", "ops@shop", "--reason", "lost claim")
    assert adopted.exit_code == 0, adopted.output
    assert "adopted as" in adopted.stdout
    retry = pay(executor, "order-2")
    assert retry.replayed and retry.state is State.SUCCEEDED
    again = run(db_url, *adopt, "--actor", "ops@shop", "--reason", "lost claim")
    assert again.exit_code == 1 and "adopted already" in again.stderr
    assert len(sandbox.ledger()) == effects  # the tools called no provider


def test_a_bad_file_is_refused_in_one_line_and_the_others_imported(
    db_url: str, executor: Executor, sandbox: SandboxServer, tmp_path: Path
) -> None:
    pay(executor, "order-1")
    good = tmp_path / "good.csv"
    good.write_bytes(sandbox.settlement_report())
    bad = tmp_path / "bad.csv"
    bad.write_bytes(good.read_bytes().replace(b",42.00,", b",42.0O,", 1))

    result = run(db_url, "recon", "import", "--provider", "sandbox", str(bad), str(good))

    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {bad}, row 2, column 'gross'") and "Traceback" not in line
    assert "good.csv" in result.stdout and "matched" in result.stdout
    files = json.loads(run(db_url, "recon", "report", "--json").stdout)["files"]
    assert [Path(f["name"]).name for f in files] == ["good.csv"]


def test_a_file_of_another_merchant_account_is_refused(
    db_url: str, executor: Executor, sandbox: SandboxServer, tmp_path: Path
) -> None:
    pay(executor, "order-1")
    path = tmp_path / "settlement_detail_report_batch_1.csv"
    path.write_bytes(sandbox.settlement_report(format="adyen"))
    args = ["recon", "import", "--provider", "sandbox", "--format", "adyen", str(path)]

    refused = run(db_url, *args, "--account", "OtherMerchant")
    assert refused.exit_code == 1
    assert "not 'OtherMerchant'" in refused.stderr and len(refused.stderr.splitlines()) == 1
    assert json.loads(run(db_url, "recon", "report", "--json").stdout)["files"] == []

    accepted = run(db_url, *args, "--account", "SandboxMerchant", "--json")
    assert accepted.exit_code == 0, accepted.output
    (result,) = json.loads(accepted.stdout)["imports"]
    assert result["counts"] == {"matched": 1, "other": 1}


def test_an_unknown_format_is_refused_before_anything(db_url: str, tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    path.write_text("a,b\n1,2\n")
    result = run(db_url, "recon", "import", "--provider", "acme", str(path))
    assert result.exit_code == 1 and "stripe" in result.stderr and "adyen" in result.stderr
