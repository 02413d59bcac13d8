"""docs/integrations.md's Flask and ASGI snippets run as written (read from the file now,
never copied here), against the loopback sandbox, on SQLite and PostgreSQL: a payment, its
replay, the operation resource, the app's own route; an unmigrated database stops them."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from payorch.errors import SchemaNotReady
from payorch.providers.sandbox import SandboxServer

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "integrations.md"
PAYMENT = {"amount": 1999, "currency": "EUR"}


def snippet(*needles: str) -> str:
    """The first python block of the doc holding every needle."""
    for block in re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.M | re.S):
        if all(n in block for n in needles):
            return str(block)
    raise AssertionError(f"no python block with {needles} in {DOC.name}")


def run_snippet(code: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "snippet"}
    exec(compile(code, str(DOC), "exec"), namespace)  # the doc's own text, as a reader runs it
    return namespace


@pytest.fixture
def environment(monkeypatch: pytest.MonkeyPatch, db_url: str, sandbox: SandboxServer) -> None:
    monkeypatch.setenv("PAYORCH_DATABASE_URL", db_url)
    monkeypatch.setenv("PAYORCH_SANDBOX_URL", sandbox.url)
    monkeypatch.setenv("PAYORCH_SANDBOX_WEBHOOK_SECRET", sandbox.webhook_secret)


@pytest.mark.usefixtures("environment")
def test_the_flask_snippet_serves(sandbox: SandboxServer) -> None:
    ns = run_snippet(snippet("payorch.integrations.flask"))
    client = ns["app"].test_client()
    headers = {"Idempotency-Key": "doc-1", "X-Tenant-Id": "shop-1"}
    first = client.post("/payments", headers=headers, json=PAYMENT)
    assert first.status_code == 201, first.text
    replay = client.post("/payments", headers=headers, json=PAYMENT)
    assert replay.data == first.data and replay.headers["Idempotent-Replayed"] == "true"
    polled = client.get(first.headers["Location"], headers={"X-Tenant-Id": "shop-1"})
    assert polled.status_code == 200 and polled.json["state"] == "succeeded"  # type: ignore[index]
    ns["payorch"].close()
    ours = [e for e in sandbox.ledger() if e["metadata"].get("payorch_tenant_id") == "shop-1"]
    assert len(ours) == 1


@pytest.mark.usefixtures("environment")
def test_the_asgi_snippet_serves(sandbox: SandboxServer) -> None:
    ns = run_snippet(snippet("PayorchMiddleware"))
    app = ns["app"]

    async def scenario() -> None:
        await app.startup()  # what the lifespan runs first
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            headers = {"Idempotency-Key": "doc-2", "X-Tenant-Id": "shop-2"}
            first = await client.post("/payments", headers=headers, json=PAYMENT)
            assert first.status_code == 201, first.text
            replay = await client.post("/payments", headers=headers, json=PAYMENT)
            assert replay.content == first.content
            assert replay.headers["Idempotent-Replayed"] == "true"
            polled = await client.get(first.headers["Location"], headers={"X-Tenant-Id": "shop-2"})
            assert polled.status_code == 200 and polled.json()["state"] == "succeeded"
            listing = await client.get("/payments")  # the app's own route
            assert listing.status_code == 200 and listing.json() == {"payments": []}
        await app.shutdown()

    asyncio.run(scenario())
    ours = [e for e in sandbox.ledger() if e["metadata"].get("payorch_tenant_id") == "shop-2"]
    assert len(ours) == 1


def test_the_flask_snippet_refuses_an_unmigrated_database(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sandbox: SandboxServer
) -> None:
    monkeypatch.setenv("PAYORCH_DATABASE_URL", f"sqlite:///{tmp_path / 'fresh.db'}")
    monkeypatch.setenv("PAYORCH_SANDBOX_URL", sandbox.url)
    monkeypatch.setenv("PAYORCH_SANDBOX_WEBHOOK_SECRET", sandbox.webhook_secret)
    with pytest.raises(SchemaNotReady, match="payorch db upgrade"):
        run_snippet(snippet("payorch.integrations.flask"))
