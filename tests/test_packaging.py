"""The wheel, installed in a fresh virtual environment, is a library a service can use.

Builds the wheel from this checkout, installs it (dependencies come from the package
index) into a new venv outside the repository, and there creates the tables, runs the demo
and imports the package. The distribution must install ``payorch`` and nothing else at the
top level.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    # Built from a copy: the build leaves build/ and *.egg-info beside the sources, and a
    # stale build/lib in the checkout would slip removed modules into later wheels.
    source = tmp_path_factory.mktemp("source") / "payorch"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            ".typecheck",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            ".*_cache",
            ".hypothesis",
            "*.db",
        ),
    )
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(source)],
        source,
    )
    wheels = list(dist.glob("payorch-*.whl"))
    assert len(wheels) == 1
    env_dir = tmp_path_factory.mktemp("fresh") / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", str(wheels[0])], dist)
    return env_dir


def clean_env() -> dict[str, str]:
    # Nothing from this checkout may leak in: no PYTHONPATH, no payorch settings.
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PAYORCH_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }


def test_only_payorch_is_installed_at_the_top_level(installed: Path) -> None:
    site = next((installed / "lib").glob("python3*/site-packages"))
    record = next(site.glob("payorch-*.dist-info")) / "RECORD"
    tops = {line.split(",", 1)[0].split("/", 1)[0] for line in record.read_text().splitlines()}
    tops = {t for t in tops if not t.endswith(".dist-info") and t != ".."}
    assert tops == {"payorch"}
    migrations = site / "payorch" / "migrations"
    assert (migrations / "env.py").is_file()
    assert list((migrations / "versions").glob("payorch_*.py"))


def test_db_upgrade_demo_and_import_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    bindir = installed / "bin"
    env = clean_env()
    url = f"sqlite:///{tmp_path / 'app.db'}"
    out = run([str(bindir / "payorch"), "db", "upgrade", "--database-url", url], tmp_path, env)
    assert "payorch_0007" in out
    out = run([str(bindir / "payorch"), "db", "current", "--database-url", url], tmp_path, env)
    assert "up to date" in out
    out = run([str(bindir / "payorch"), "demo", "--payments", "50"], tmp_path, env)
    assert "duplicates" in out.lower()
    code = (
        "import payorch, payorch.providers.sandbox, payorch.providers.stripe, payorch.cli._app;"
        "from payorch.migrate import upgrade;"
        f"upgrade({str(url)!r});"
        "print(payorch.__file__)"
    )
    out = run([str(bindir / "python"), "-c", code], tmp_path, env)
    assert str(installed) in out
