"""The newcomer's path, from the docs alone: a FastAPI service built from the snippet in
docs/embedding.md (read from the file now, never copied here), served by a real uvicorn
process against a database nobody migrated.

It must refuse to start, and say why on stderr although the service configured no logging
(payorch installs no NullHandler: Python's last resort prints its ERROR line). Then the real
``payorch db upgrade`` runs, and the same service, now with the docs' uvicorn log
configuration, serves a payment and its replay: one effect at the sandbox. SQLite and
PostgreSQL.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi_server import free_port

from payorch.providers.sandbox import SandboxServer
from payorch.storage._schema import known_revisions

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EMBEDDING = ROOT / "docs" / "embedding.md"
PAYORCH = Path(sys.executable).with_name("payorch")
START_WITHIN = 60.0  # seconds: imports and the lifespan, bounded
PAYMENT = b'{"amount": 1999, "currency": "EUR"}'


def fenced(text: str, language: str, *needles: str) -> str:
    """The first ``language`` block of ``text`` holding every needle."""
    for block in re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S):
        if all(n in block for n in needles):
            return str(block)
    raise AssertionError(f"no {language} block with {needles} in the docs")


@pytest.fixture(params=["sqlite", "postgres"])
def unmigrated_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'payments.db'}"
    from test_schema_check import fresh_pg_database

    return fresh_pg_database(request, request.getfixturevalue("pg_server_url"))


@pytest.fixture
def service_dir(tmp_path: Path) -> Path:
    """The snippets as a newcomer saves them: service.py and logging.json."""
    docs = EMBEDDING.read_text()
    folder = tmp_path / "service"
    folder.mkdir()
    (folder / "service.py").write_text(fenced(docs, "python", "Payorch(", "FastAPI("))
    (folder / "logging.json").write_text(fenced(docs, "json", '"payorch"', '"uvicorn"'))
    return folder


def environment(url: str, sandbox: SandboxServer) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
    env.update(
        PAYORCH_DATABASE_URL=url,
        PAYORCH_SANDBOX_URL=sandbox.url,
        PAYORCH_SANDBOX_WEBHOOK_SECRET=sandbox.webhook_secret or "",
    )
    return env


def uvicorn(folder: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "service:app",
        "--app-dir",
        str(folder),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]


class Served:
    """The service in a uvicorn process, its stderr in a file; ready once it answers."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / "served.log"
        cmd = uvicorn(folder, self.port, "--log-config", str(folder / "logging.json"))
        self._out = self.log.open("wb")
        self.proc = subprocess.Popen(cmd, cwd=folder, env=env, stderr=self._out)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_WITHIN
        while True:  # bounded: the deadline, or the process gone
            assert self.proc.poll() is None, self.stderr()
            try:
                if httpx.get(f"{self.url}/openapi.json", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"not ready in {START_WITHIN}s: {self.stderr()}"
            time.sleep(0.05)  # a polling interval, not a synchronisation

    def stop(self) -> None:
        self.proc.terminate()  # SIGTERM: uvicorn runs the lifespan's shutdown
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)
        self._out.close()

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def served(service_dir: Path) -> Iterator[list[Served]]:
    started: list[Served] = []
    try:
        yield started
    finally:
        for server in started:
            if server.proc.poll() is None:
                server.stop()


def pay(url: str, tenant: str, key: str) -> httpx.Response:
    headers = {"X-Tenant-Id": tenant, "Idempotency-Key": f'"{key}"'}
    headers["Content-Type"] = "application/json"
    return httpx.post(f"{url}/payments", headers=headers, content=PAYMENT, timeout=30.0)


def effects(sandbox: SandboxServer, tenant: str) -> list[dict[str, Any]]:
    return [e for e in sandbox.ledger() if e["metadata"].get("payorch_tenant_id") == tenant]


def test_the_docs_service_refuses_an_unmigrated_database_then_serves_after_upgrade(
    unmigrated_url: str, service_dir: Path, sandbox: SandboxServer, served: list[Served]
) -> None:
    env = environment(unmigrated_url, sandbox)
    head = known_revisions()[0]

    # 1. The newcomer forgot `payorch db upgrade` and configured no logging: no start.
    refused = subprocess.run(
        uvicorn(service_dir, free_port()),
        cwd=service_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=START_WITHIN,
        check=False,
    )
    assert refused.returncode != 0
    # payorch's own line (the last-resort handler: nothing was configured), then uvicorn's.
    assert "payorch cannot start: no payorch tables" in refused.stderr
    assert f"this payorch needs revision {head}" in refused.stderr
    assert "run `payorch db upgrade` against this database" in refused.stderr
    assert "Application startup failed" in refused.stderr

    # 2. What the message says to run: the real command, against the same URL.
    upgraded = subprocess.run(
        [str(PAYORCH), "db", "upgrade"],
        cwd=service_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert upgraded.returncode == 0, upgraded.stderr
    assert f"database at revision {head}" in upgraded.stdout

    # 3. The same service starts (with the docs' log configuration) and serves.
    server = Served(service_dir, env)
    served.append(server)
    server.wait_ready()
    tenant, key = f"shop-{uuid.uuid4().hex[:8]}", f"order-{uuid.uuid4().hex}"
    first = pay(server.url, tenant, key)
    assert first.status_code == 201, first.text
    assert first.json()["state"] == "succeeded"
    again = pay(server.url, tenant, key)
    assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert len(effects(sandbox, tenant)) == 1
    server.stop()
    # The docs' logging.json shows payorch's INFO lines, and no refusal.
    logged = server.stderr()
    assert "operation.transition" in logged and "payorch cannot start" not in logged


def test_the_readme_shows_the_service_the_newcomer_test_serves() -> None:
    """The README's FastAPI block is docs/embedding.md's service, so what a reader copies
    from the front page is what this file proves."""
    readme = (ROOT / "README.md").read_text()
    docs = EMBEDDING.read_text()
    assert fenced(readme, "python", "# service.py") == fenced(docs, "python", "# service.py")
