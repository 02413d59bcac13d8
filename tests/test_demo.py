"""`payorch demo` as a user runs it: a real subprocess, exit 0, zero duplicates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
