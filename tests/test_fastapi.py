"""FastAPI: the example app served by a real uvicorn process, driven with httpx against the
loopback sandbox, on SQLite and PostgreSQL; the tenant resolvers on an app in this process.

No ``from __future__ import annotations`` here: FastAPI reads the endpoints' annotations,
and those naming a local dependency must be evaluated where it is in scope."""

import asyncio
import json
import shutil
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
import sqlalchemy as sa
from conftest import DROP_HOLD_SECONDS, FAST_TIMEOUT, Ledger, create_pg_database
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from fastapi_server import UvicornServer

from payorch import migrate
from payorch.errors import ConfigurationError
from payorch.integrations.fastapi import (
    Idempotent,
    Payorch,
    TenantResolver,
    path_tenant,
    principal_tenant,
)
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.storage._tables import events, operations, webhook_inbox

pytestmark = pytest.mark.slow

PAYMENT = {"amount": 1999, "currency": "EUR", "customer": "cus_42"}
PROBLEM = "application/problem+json"


@dataclass
class Stack(Ledger):
    url: str  # the uvicorn server
    sandbox: SandboxServer
    engine: sa.Engine

    def count(self, table: sa.Table, tenant: str) -> int:
        query = sa.select(sa.func.count()).select_from(table).where(table.c.tenant_id == tenant)
        with self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

    def rows(self, tenant: str) -> int:
        return self.count(operations, tenant)

    def inbox(self, tenant: str) -> list[str]:
        query = sa.select(webhook_inbox.c.result).where(webhook_inbox.c.tenant_id == tenant)
        with self.engine.connect() as conn:
            return [r.result for r in conn.execute(query)]


@pytest.fixture(scope="module")
def acquirer() -> Iterator[SandboxServer]:
    # drop_hold: a dropped answer holds the socket, then closes it: the call is ambiguous.
    with SandboxServer(drop_hold_seconds=DROP_HOLD_SECONDS) as sb:
        yield sb


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def module_db(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    if request.param == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        target = tmp_path_factory.mktemp("fastapi") / "payorch.db"
        shutil.copyfile(template, target)
        return f"sqlite:///{target}"
    url = create_pg_database(request.getfixturevalue("pg_server_url"), "payorch_fastapi")
    migrate.upgrade(url)
    return url


@pytest.fixture(scope="module")
def stack(module_db: str, acquirer: SandboxServer) -> Iterator[Stack]:
    env = {
        "PAYORCH_DATABASE_URL": module_db,
        "PAYORCH_SANDBOX_URL": acquirer.url,
        "PAYORCH_SANDBOX_WEBHOOK_SECRET": acquirer.webhook_secret,
    }
    engine = sa.create_engine(module_db)
    try:
        with UvicornServer(env=env) as server:
            yield Stack(url=server.url, sandbox=acquirer, engine=engine)
    finally:
        engine.dispose()


@pytest.fixture
def tenant() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"  # each test its own tenant: its own rows and effects


@pytest.fixture
def client(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=30.0) as c:
        yield c


Headers = list[tuple[str, str | bytes]]


def post(
    client: httpx.Client,
    tenant: str | None,
    key: str | bytes | None,
    body: dict[str, Any] | bytes = PAYMENT,
    extra: Headers | None = None,
) -> httpx.Response:
    headers: Headers = [("Content-Type", "application/json"), *(extra or [])]
    if tenant is not None:
        headers.append(("X-Tenant-Id", tenant))
    if key is not None:
        headers.append(("Idempotency-Key", key))
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post("/payments", headers=headers, content=content)


def delivery_for(stack: Stack, tenant: str, op_id: str) -> tuple[dict[str, str], bytes]:
    """The sandbox's webhook for the operation: its effect carries our downstream key."""
    key = stack.downstream_key(tenant, op_id)
    for d in stack.sandbox.webhook_deliveries():
        if json.loads(d.body)["data"].get("idempotency_key") == key:
            return d.headers, d.body
    raise AssertionError(f"the sandbox sent no webhook for {op_id} ({key})")


# -- the contract, over a real server ------------------------------------------------------


def test_fresh_then_replay_is_one_effect(stack: Stack, client: httpx.Client, tenant: str) -> None:
    first = post(client, tenant, "order-1")
    assert first.status_code == 201, first.text
    op_id = first.json()["operation_id"]
    assert first.json()["state"] == "succeeded" and "Idempotent-Replayed" not in first.headers
    assert first.headers["Payorch-Operation-Id"] == op_id
    assert first.headers["Location"] == f"/operations/{op_id}"
    replay = post(client, tenant, "order-1")
    assert replay.status_code == 201 and replay.content == first.content
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert len(stack.effects(tenant)) == 1 and stack.rows(tenant) == 1
    # The Location names the operation, readable by its own tenant only.
    polled = client.get(first.headers["Location"], headers={"X-Tenant-Id": tenant})
    assert polled.status_code == 200 and polled.json()["state"] == "succeeded"
    other = client.get(first.headers["Location"], headers={"X-Tenant-Id": f"{tenant}-b"})
    assert other.status_code == 404 and other.headers["content-type"] == PROBLEM


def test_quoted_and_bare_forms_are_one_operation(
    stack: Stack, client: httpx.Client, tenant: str
) -> None:
    quoted = post(client, tenant, '"8e03978e-40d5-43e8-bc93-6894a57f9324"')
    bare = post(client, tenant, "8e03978e-40d5-43e8-bc93-6894a57f9324")
    assert quoted.status_code == bare.status_code == 201
    assert bare.headers["Idempotent-Replayed"] == "true" and bare.content == quoted.content
    assert len(stack.effects(tenant)) == 1 and stack.rows(tenant) == 1


def test_twenty_concurrent_duplicates_make_one_effect(
    stack: Stack, client: httpx.Client, tenant: str
) -> None:
    with stack.sandbox.hold_commits() as gate, ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(post, client, tenant, "dup-1") for _ in range(20)]
        assert gate.wait_held(1, timeout=30)  # one request is at the provider, held there
        # The other 19 find it in progress and are answered while it is held.
        early = [f.result() for f in islice(as_completed(futures, timeout=60), 19)]
        gate.release()
        answers = [f.result(timeout=60) for f in futures]
    assert [r.status_code for r in early] == [409] * 19
    assert all(int(r.headers["Retry-After"]) >= 1 for r in early)
    assert {r.json()["type"] for r in early} == {"urn:payorch:problem:operation-in-progress"}
    assert {r.headers["content-type"] for r in early} == {PROBLEM}
    assert Counter(r.status_code for r in answers) == {409: 19, 201: 1}
    assert len(stack.effects(tenant)) == 1 and stack.rows(tenant) == 1
    late = post(client, tenant, "dup-1")  # after the first finished: its replay
    assert late.status_code == 201 and late.headers["Idempotent-Replayed"] == "true"


def test_changed_amount_is_422_and_nothing_executed(
    stack: Stack, client: httpx.Client, tenant: str
) -> None:
    assert post(client, tenant, "order-2").status_code == 201
    changed = post(client, tenant, "order-2", {**PAYMENT, "amount": 2000})
    assert changed.status_code == 422 and changed.headers["content-type"] == PROBLEM
    assert changed.json()["type"] == "urn:payorch:problem:idempotency-key-reused"
    assert len(stack.effects(tenant)) == 1 and stack.rows(tenant) == 1


def test_dropped_answer_is_202_then_a_signed_webhook_settles_it(
    stack: Stack, client: httpx.Client, tenant: str
) -> None:
    stack.sandbox.inject("drop_after")
    unknown = post(client, tenant, "order-3")
    assert unknown.status_code == 202, unknown.text
    op_id = unknown.json()["operation_id"]
    assert unknown.json()["state"] == "outcome_unknown" and unknown.json()["retry"] == "same_key"
    location = unknown.headers["Location"]
    polled = client.get(location, headers={"X-Tenant-Id": tenant})
    assert polled.status_code == 200 and polled.json()["state"] == "outcome_unknown"
    assert polled.headers["Retry-After"] == "1"
    again = post(client, tenant, "order-3")  # never re-executed while unknown
    assert again.status_code == 202 and len(stack.effects(tenant)) == 1
    assert len(stack.effects_of(tenant, op_id)) == 1  # committed there, answer dropped

    headers, body = delivery_for(stack, tenant, op_id)
    hook = client.post(f"/webhooks/{tenant}/sandbox", headers=headers, content=body)
    assert hook.status_code == 200 and hook.json()["status"] == "applied", hook.text
    replay = post(client, tenant, "order-3")
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json()["state"] == "succeeded" and replay.json()["operation_id"] == op_id
    assert client.get(location, headers={"X-Tenant-Id": tenant}).json()["state"] == "succeeded"
    assert len(stack.effects(tenant)) == 1 and stack.inbox(tenant) == ["applied"]


BAD_REQUESTS: dict[str, tuple[dict[str, Any], int, str]] = {
    "missing key": ({"key": None}, 400, "invalid-idempotency-key"),
    "empty key": ({"key": ""}, 400, "invalid-idempotency-key"),
    "list-valued key": ({"key": "a, b"}, 400, "invalid-idempotency-key"),
    "two key lines": ({"extra": [("Idempotency-Key", "b")]}, 400, "invalid-idempotency-key"),
    "non-ASCII key": ({"key": "café".encode()}, 400, "invalid-idempotency-key"),
    "badly quoted key": ({"key": '"abc'}, 400, "invalid-idempotency-key"),
    "over-long key": ({"key": "k" * 256}, 400, "invalid-idempotency-key"),
    "body not JSON": ({"body": b"amount=1999"}, 400, "request-body-not-json"),
    "body NaN": ({"body": b'{"amount": NaN}'}, 400, "request-body-not-json"),
    "body a list": ({"body": b"[1, 2]"}, 422, "request-validation-failed"),
    "body a float amount": (
        {"body": {**PAYMENT, "amount": 19.99}},
        422,
        "request-validation-failed",
    ),
    "no tenant": ({"tenant": None}, 400, "invalid-tenant"),
    "bad tenant": ({"tenant": "a b"}, 400, "invalid-tenant"),
    "body too large": ({"body": b" " * ((1 << 20) + 1)}, 413, "request-body-too-large"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_is_a_problem_and_writes_nothing(
    stack: Stack, client: httpx.Client, tenant: str, case: str
) -> None:
    given, status, problem_type = BAD_REQUESTS[case]
    response = post(
        client,
        given.get("tenant", tenant),
        given.get("key", "k-bad"),
        given.get("body", PAYMENT),
        given.get("extra"),
    )
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    assert response.json()["type"] == f"urn:payorch:problem:{problem_type}"
    assert stack.rows(tenant) == 0 and stack.effects(tenant) == []


def test_a_forged_webhook_is_400_and_writes_nothing(
    stack: Stack, client: httpx.Client, tenant: str
) -> None:
    stack.sandbox.inject("drop_after")
    op_id = post(client, tenant, "order-4").json()["operation_id"]
    headers, body = delivery_for(stack, tenant, op_id)
    before = stack.count(events, tenant)
    forged = {**headers, "webhook-signature": "v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="}
    tampered = body.replace(b'"succeeded"', b'"declined"')
    for h, b in ((forged, body), (headers, tampered)):
        refused = client.post(f"/webhooks/{tenant}/sandbox", headers=h, content=b)
        assert refused.status_code == 400 and refused.headers["content-type"] == PROBLEM
        assert refused.json()["type"] == "urn:payorch:problem:webhook-signature-invalid"
    unknown_provider = client.post(f"/webhooks/{tenant}/nobody", headers=headers, content=body)
    assert unknown_provider.status_code == 404
    assert stack.inbox(tenant) == [] and stack.count(events, tenant) == before
    polled = client.get(f"/operations/{op_id}", headers={"X-Tenant-Id": tenant})
    assert polled.json()["state"] == "outcome_unknown"


# -- tenant resolvers and configuration, on an app in this process ------------------------


@dataclass
class User:
    tenant_id: str | None


async def current_user(request: Request) -> User | None:
    """Stands for an app's authentication dependency (a bearer token, a session…)."""
    token = request.headers.get("Authorization", "")
    return User(tenant_id=token.removeprefix("Bearer ") or None) if token else None


def build_app(
    sqlite_url: str, sandbox: SandboxServer, tenant: TenantResolver, operations: str
) -> tuple[FastAPI, Payorch]:
    adapter = SandboxProvider(
        base_url=sandbox.url, webhook_secret=sandbox.webhook_secret, timeout=FAST_TIMEOUT
    )
    payorch = Payorch(url=sqlite_url, providers=[adapter], tenant=tenant)
    app = FastAPI(lifespan=payorch.lifespan, exception_handlers=payorch.exception_handlers)
    app.include_router(payorch.router(operations=operations))
    dependency = payorch.operation("payment.create", status_code=201)

    @app.post("/t/{tenant}/payments")
    async def by_path(op: Annotated[Idempotent, Depends(dependency)]) -> Response:
        return await op.run()

    app.add_api_route("/payments", payorch.endpoint("payment.create"), methods=["POST"])
    return app, payorch


@asynccontextmanager
async def serving(app: FastAPI, payorch: Payorch) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with (
        payorch.lifespan(app),
        httpx.AsyncClient(transport=transport, base_url="http://app") as client,
    ):
        yield client


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    target = tmp_path / "payorch.db"
    shutil.copyfile(sqlite_template, target)
    return f"sqlite:///{target}"


def count_rows(url: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(sa.select(sa.func.count()).select_from(operations)).scalar_one()
            )
    finally:
        engine.dispose()


def test_tenant_from_a_path_parameter(sqlite_url: str, acquirer: SandboxServer) -> None:
    app, payorch = build_app(sqlite_url, acquirer, path_tenant("tenant"), "/t/{tenant}/operations")

    async def scenario() -> None:
        async with serving(app, payorch) as client:
            key = {"Idempotency-Key": "p-1"}
            first = await client.post("/t/shop-a/payments", headers=key, json=PAYMENT)
            assert first.status_code == 201, first.text
            op_id = first.json()["operation_id"]
            assert first.headers["Location"] == f"/t/shop-a/operations/{op_id}"
            # The same key under another tenant is another operation.
            other = await client.post("/t/shop-b/payments", headers=key, json=PAYMENT)
            assert other.status_code == 201 and other.json()["operation_id"] != op_id
            mine = await client.get(first.headers["Location"])
            assert mine.status_code == 200 and mine.json()["operation_id"] == op_id
            theirs = await client.get(f"/t/shop-b/operations/{op_id}")
            assert theirs.status_code == 404
            # A route without {tenant}: the app's mistake, a 500 that says "same key".
            broken = await client.post("/payments", headers={"Idempotency-Key": "p-2"}, json={})
            assert broken.status_code == 500 and broken.json()["retry"] == "same_key"

    asyncio.run(scenario())
    assert count_rows(sqlite_url) == 2


def test_tenant_from_the_principal_never_from_the_body(
    sqlite_url: str, acquirer: SandboxServer
) -> None:
    app, payorch = build_app(sqlite_url, acquirer, principal_tenant(current_user), "/operations")

    async def scenario() -> None:
        async with serving(app, payorch) as client:
            body = {**PAYMENT, "tenant_id": "victim"}  # not how a tenant is chosen
            anonymous = await client.post(
                "/payments", headers={"Idempotency-Key": "u-1"}, json=body
            )
            assert anonymous.status_code == 401
            assert anonymous.json()["type"] == "urn:payorch:problem:tenant-unresolved"
            auth = {"Idempotency-Key": "u-1", "Authorization": "Bearer shop-c"}
            ok = await client.post("/payments", headers=auth, json=PAYMENT)
            assert ok.status_code == 200, ok.text
            location = f"/operations/{ok.json()['operation_id']}"  # a 200 names no Location
            assert (await client.get(location, headers=auth)).status_code == 200
            assert (await client.get(location)).status_code == 401

    asyncio.run(scenario())
    engine = sa.create_engine(sqlite_url)
    with engine.connect() as conn:
        assert [r.tenant_id for r in conn.execute(sa.select(operations.c.tenant_id))] == ["shop-c"]
    engine.dispose()


def test_lifespan_refuses_an_app_without_the_handlers(
    sqlite_url: str, acquirer: SandboxServer
) -> None:
    adapter = SandboxProvider(base_url=acquirer.url, webhook_secret=acquirer.webhook_secret)
    payorch = Payorch(url=sqlite_url, providers=[adapter])

    async def start() -> None:
        async with payorch.lifespan(FastAPI()):
            raise AssertionError("started without the exception handlers")

    with pytest.raises(ConfigurationError, match="exception_handlers"):
        asyncio.run(start())
    with pytest.raises(ConfigurationError, match="200 or 201"):
        payorch.operation("payment.create", status_code=202)
    asyncio.run(payorch.store.close())
    adapter.close()


def test_the_core_never_imports_fastapi() -> None:
    code = (
        "import sys, payorch, payorch.execution._async, payorch.http, payorch.integrations;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'starlette')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
