"""The adapter kit failing as an adapter author needs it to: a check that needs a fault hook
the emulator lacks fails and names the hook (it skips only where the adapter's declaration
makes the fault irrelevant), and a failing check shows the values it compared.

The kit runs as its users run it: a test module of their own, subclassing ``AdapterContract``,
collected by a pytest process of its own (where nothing but ``payorch.testing`` itself can
register the kit's modules for assertion rewriting).
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from payorch.testing import Fault
from payorch.testing._support import require_fault

USER_MODULE = '''
from collections.abc import Iterator

import pytest

from payorch.providers.sandbox import SandboxServer
from payorch.providers.sandbox.emulator import SandboxEmulator
from payorch.testing import AdapterContract, Fault


class Hookless(SandboxEmulator):
    """An emulator whose author implemented no fault hook yet."""

    @property
    def faults(self) -> frozenset[Fault]:
        return frozenset()


class Miscounting(SandboxEmulator):
    """An emulator (or an adapter) that makes two effects where one is due."""

    def effects(self, downstream_key: str) -> int:
        return super().effects(downstream_key) + 1


class TestHookless(AdapterContract):
    @pytest.fixture
    def emulator(self) -> Iterator[Hookless]:
        with SandboxServer() as server:
            yield Hookless(server)


class TestMiscounting(AdapterContract):
    @pytest.fixture
    def emulator(self) -> Iterator[Miscounting]:
        with SandboxServer() as server:
            yield Miscounting(server)
'''


def run_kit(tmp_path: Path, selection: str) -> dict[str, tuple[str, str]]:
    """Each selected check's outcome (passed, failed, skipped) and its report text."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # the rootdir: not payorch's settings
    (tmp_path / "test_acme_contract.py").write_text(USER_MODULE)
    report = tmp_path / "report.xml"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-k", selection]
    command += [f"--junitxml={report}", "test_acme_contract.py"]
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 1, done.stdout + done.stderr  # 1: some checks failed
    outcomes: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        found = [child for child in case if child.tag in ("failure", "error", "skipped")]
        kind = found[0].tag if found else "passed"
        text = found[0].get("message", "") + "\n" + (found[0].text or "") if found else ""
        outcomes[name] = (kind, text)
    return outcomes


@pytest.mark.slow
def test_missing_fault_hooks_fail_naming_them_and_a_failure_shows_its_values(
    tmp_path: Path,
) -> None:
    selection = "fault or out_of_order or contradicting or the_same_key_gets"
    outcomes = run_kit(tmp_path, selection)

    # Every check that needs a fault the hookless emulator cannot inject fails, none skips.
    needing = [f"TestHookless::test_a_fault_is_classified[{f.value}]" for f in Fault]
    needing += [
        f"TestHookless::test_async_a_possibly_sent_fault_is_ambiguous[{f.value}]"
        for f in (Fault.ERROR_AFTER_COMMIT, Fault.ERROR_BEFORE_COMMIT)
    ]
    needing += [
        "TestHookless::test_out_of_order_deliveries_settle_each_operation_once",
        "TestHookless::test_contradicting_evidence_is_flagged_not_applied",
    ]
    assert {name: outcomes[name][0] for name in needing} == dict.fromkeys(needing, "failure")
    decline = outcomes["TestHookless::test_a_fault_is_classified[decline]"][1]
    assert "the emulator lacks the decline fault hook" in decline
    assert "list Fault.DECLINE in its `faults` and make `inject(Fault.DECLINE)`" in decline
    webhook = outcomes["TestHookless::test_out_of_order_deliveries_settle_each_operation_once"]
    assert "Fault.ERROR_AFTER_COMMIT" in webhook[1] and "Fault.DROP_AFTER_COMMIT" in webhook[1]
    assert not [n for n, (kind, _) in outcomes.items() if kind == "skipped"]
    # What needs no fault still runs and passes.
    assert outcomes["TestHookless::test_the_same_key_gets_the_same_answer"][0] == "passed"

    # A check that fails shows what it compared (pytest's assertion rewriting), not a bare
    # AssertionError.
    kind, text = outcomes["TestMiscounting::test_the_same_key_gets_the_same_answer"]
    assert kind == "failure"
    assert "assert 2 == 1" in text, text
    assert "where 2 = " in text, text


class _Emulator:
    faults: frozenset[Fault] = frozenset()


class _Adapter:
    def __init__(self, window: timedelta | None) -> None:
        self.idempotency_window = window


def test_a_fault_the_adapter_declares_irrelevant_skips_saying_why() -> None:
    adapter: Any = _Adapter(window=None)  # a provider that honours no idempotency key
    with pytest.raises(pytest.skip.Exception, match=r"in_flight does not apply: .*honours no"):
        require_fault(_Emulator(), Fault.IN_FLIGHT, adapter)
    # Every other fault applies to it all the same.
    with pytest.raises(pytest.fail.Exception, match="lacks the rate_limited fault hook"):
        require_fault(_Emulator(), Fault.RATE_LIMITED, adapter)


def test_in_flight_applies_to_an_adapter_with_a_window() -> None:
    adapter: Any = _Adapter(window=timedelta(hours=24))
    with pytest.raises(pytest.fail.Exception, match=r"make `inject\(Fault.IN_FLIGHT\)` answer"):
        require_fault(_Emulator(), Fault.IN_FLIGHT, adapter)
