"""The HTTP contract every payorch integration keeps, driven over a real server process.

A test module subclasses :class:`ServedContract` and gives it a ``stack`` fixture: a served
app (``POST /payments`` runs ``payment.create`` with success 201; ``POST /as-sent`` runs the
body as sent with success 200; the webhook and operation routes at their default prefixes;
the tenant from ``X-Tenant-Id``, none being 401), its sandbox and its database. The same
tests then hold for Flask (WSGI) and for the ASGI middleware, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from conftest import Ledger, create_pg_database
from fastapi import FastAPI

from payorch import migrate
from payorch.integrations import fastapi as payorch_fastapi
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.storage._tables import events, operations, webhook_inbox

PAYMENT = {"amount": 1999, "currency": "EUR", "customer": "cus_42"}
PROBLEM = "application/problem+json"
Headers = list[tuple[str, str | bytes]]


@dataclass
class Stack(Ledger):
    url: str  # the served app
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


# -- databases -------------------------------------------------------------------------------


def database(
    request: pytest.FixtureRequest, where: Path, prefix: str, *, migrated: bool = True
) -> Iterator[str]:
    """A database of its own for ``request.param`` ("sqlite" or "postgres"), migrated or
    left empty; a PostgreSQL one is dropped afterwards."""
    if request.param == "sqlite":
        target = where / "payorch.db"
        if migrated:
            shutil.copyfile(request.getfixturevalue("sqlite_template"), target)
        yield f"sqlite:///{target}"
        return
    server: str = request.getfixturevalue("pg_server_url")
    url = create_pg_database(server, prefix)
    if migrated:
        migrate.upgrade(url)
    try:
        yield url
    finally:
        drop_pg_database(server, url)


def drop_pg_database(server_url: str, url: str) -> None:
    name = sa.make_url(url).database
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def served_env(url: str, sandbox: SandboxServer) -> dict[str, str]:
    return {
        "PAYORCH_DATABASE_URL": url,
        "PAYORCH_SANDBOX_URL": sandbox.url,
        "PAYORCH_SANDBOX_WEBHOOK_SECRET": sandbox.webhook_secret,
    }


# -- requests --------------------------------------------------------------------------------


def post(
    client: httpx.Client,
    tenant: str | None,
    key: str | bytes | None,
    body: dict[str, Any] | bytes = PAYMENT,
    extra: Headers | None = None,
    path: str = "/payments",
) -> httpx.Response:
    headers: Headers = [("Content-Type", "application/json"), *(extra or [])]
    if tenant is not None:
        headers.append(("X-Tenant-Id", tenant))
    if key is not None:
        headers.append(("Idempotency-Key", key))
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, headers=headers, content=content)


def delivery_for(stack: Stack, tenant: str, op_id: str) -> tuple[dict[str, str], bytes]:
    """The sandbox's webhook for the operation: its effect carries our downstream key."""
    key = stack.downstream_key(tenant, op_id)
    for d in stack.sandbox.webhook_deliveries():
        if json.loads(d.body)["data"].get("idempotency_key") == key:
            return d.headers, d.body
    raise AssertionError(f"the sandbox sent no webhook for {op_id} ({key})")


FORGED_SIGNATURE = "v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
SIGNATURE_INVALID = "urn:payorch:problem:webhook-signature-invalid"


def repeated_signature(headers: dict[str, str], *, forged_first: bool) -> list[tuple[str, str]]:
    """The delivery's headers with two signature lines: its own and a forged one."""
    lines = [(k, v) for k, v in headers.items() if k != "webhook-signature"]
    pair = [("webhook-signature", headers["webhook-signature"])]
    pair.insert(0 if forged_first else 1, ("webhook-signature", FORGED_SIGNATURE))
    return lines + pair


def answer_of(response: httpx.Response) -> tuple[int, str, str]:
    """What a webhook answer says: its status, its media type, its result or problem type."""
    body = response.json()
    said = str(body["type"] if "type" in body else body["status"])  # a problem has both
    return response.status_code, response.headers["content-type"], said


def fastapi_answer(
    stack: Stack, tenant: str, headers: list[tuple[str, str]], body: bytes
) -> httpx.Response:
    """The FastAPI integration's answer to a delivery (the reference), in this process, on
    the stack's database and sandbox."""
    adapter = SandboxProvider(
        base_url=stack.sandbox.url, webhook_secret=stack.sandbox.webhook_secret
    )
    url = stack.engine.url.render_as_string(hide_password=False)
    payorch = payorch_fastapi.Payorch(url=url, providers=[adapter])
    app = FastAPI(exception_handlers=payorch.exception_handlers)
    app.include_router(payorch.router())

    async def deliver() -> httpx.Response:
        async with payorch.lifespan(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
                return await c.post(f"/webhooks/{tenant}/sandbox", headers=headers, content=body)

    return asyncio.run(deliver())


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
    "no tenant": ({"tenant": None}, 401, "tenant-unresolved"),
    "bad tenant": ({"tenant": "a b"}, 400, "invalid-tenant"),
    "body too large": ({"body": b" " * ((1 << 20) + 1)}, 413, "request-body-too-large"),
}


class ServedContract:
    """The contract's tests; a subclass's module gives the ``stack`` fixture."""

    # A WSGI server joins a repeated header's lines into one value before the app sees them.
    JOINS_REPEATED_HEADER_LINES = False

    @pytest.fixture
    def tenant(self) -> str:
        return f"t-{uuid.uuid4().hex[:12]}"  # each test its own tenant: its own rows and effects

    @pytest.fixture
    def client(self, stack: Stack) -> Iterator[httpx.Client]:
        with httpx.Client(base_url=stack.url, timeout=30.0) as c:
            yield c

    def test_fresh_then_replay_is_one_effect(
        self, stack: Stack, client: httpx.Client, tenant: str
    ) -> None:
        first = post(client, tenant, "order-1")
        assert first.status_code == 201, first.text
        op_id = first.json()["operation_id"]
        assert first.json()["state"] == "succeeded" and "Idempotent-Replayed" not in first.headers
        assert first.headers["Payorch-Operation-Id"] == op_id
        assert first.headers["Location"] == f"/operations/{op_id}"
        replay = post(client, tenant, "order-1")
        assert replay.status_code == 201 and replay.content == first.content, replay.text
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert len(stack.effects(tenant)) == 1 and stack.rows(tenant) == 1
        # The Location names the operation, readable by its own tenant only.
        polled = client.get(first.headers["Location"], headers={"X-Tenant-Id": tenant})
        assert polled.status_code == 200 and polled.json()["state"] == "succeeded", polled.text
        other = client.get(first.headers["Location"], headers={"X-Tenant-Id": f"{tenant}-b"})
        assert other.status_code == 404 and other.headers["content-type"] == PROBLEM
        assert client.get(first.headers["Location"]).status_code == 401  # no tenant at all

    def test_the_body_as_sent_answers_200(
        self, stack: Stack, client: httpx.Client, tenant: str
    ) -> None:
        first = post(client, tenant, "as-sent-1", path="/as-sent")
        assert first.status_code == 200, first.text
        assert first.json()["state"] == "succeeded" and "Location" not in first.headers
        assert len(stack.effects(tenant)) == 1

    def test_quoted_and_bare_forms_are_one_operation(
        self, stack: Stack, client: httpx.Client, tenant: str
    ) -> None:
        quoted = post(client, tenant, '"8e03978e-40d5-43e8-bc93-6894a57f9324"')
        bare = post(client, tenant, "8e03978e-40d5-43e8-bc93-6894a57f9324")
        assert quoted.status_code == bare.status_code == 201, bare.text
        assert bare.headers["Idempotent-Replayed"] == "true" and bare.content == quoted.content
        assert len(stack.effects(tenant)) == 1 and stack.rows(tenant) == 1

    def test_twenty_concurrent_duplicates_make_one_effect(
        self, stack: Stack, client: httpx.Client, tenant: str
    ) -> None:
        with stack.sandbox.hold_commits() as gate, ThreadPoolExecutor(20) as pool:
            futures = [pool.submit(post, client, tenant, "dup-1") for _ in range(20)]
            assert gate.wait_held(1, timeout=30)  # one request is at the provider, held there
            # The other 19 find it in progress and are answered while it is held.
            early = [f.result() for f in islice(as_completed(futures, timeout=60), 19)]
            gate.release()
            answers = [f.result(timeout=60) for f in futures]
        assert [r.status_code for r in early] == [409] * 19, [r.text for r in early]
        assert all(int(r.headers["Retry-After"]) >= 1 for r in early)
        assert {r.json()["type"] for r in early} == {"urn:payorch:problem:operation-in-progress"}
        assert {r.headers["content-type"] for r in early} == {PROBLEM}
        assert Counter(r.status_code for r in answers) == {409: 19, 201: 1}
        assert len(stack.effects(tenant)) == 1 and stack.rows(tenant) == 1
        late = post(client, tenant, "dup-1")  # after the first finished: its replay
        assert late.status_code == 201 and late.headers["Idempotent-Replayed"] == "true"

    def test_changed_amount_is_422_and_nothing_executed(
        self, stack: Stack, client: httpx.Client, tenant: str
    ) -> None:
        assert post(client, tenant, "order-2").status_code == 201
        changed = post(client, tenant, "order-2", {**PAYMENT, "amount": 2000})
        assert changed.status_code == 422 and changed.headers["content-type"] == PROBLEM
        assert changed.json()["type"] == "urn:payorch:problem:idempotency-key-reused"
        assert len(stack.effects(tenant)) == 1 and stack.rows(tenant) == 1

    def test_dropped_answer_is_202_then_a_signed_webhook_settles_it(
        self, stack: Stack, client: httpx.Client, tenant: str
    ) -> None:
        stack.sandbox.inject("drop_after")
        unknown = post(client, tenant, "order-3")
        assert unknown.status_code == 202, unknown.text
        op_id = unknown.json()["operation_id"]
        assert unknown.json()["state"] == "outcome_unknown"
        assert unknown.json()["retry"] == "same_key"
        location = unknown.headers["Location"]
        assert location == f"/operations/{op_id}"
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
        polled = client.get(location, headers={"X-Tenant-Id": tenant})
        assert polled.json()["state"] == "succeeded" and "Retry-After" not in polled.headers
        assert len(stack.effects(tenant)) == 1 and stack.inbox(tenant) == ["applied"]
        duplicate = client.post(f"/webhooks/{tenant}/sandbox", headers=headers, content=body)
        assert duplicate.status_code == 200 and duplicate.json()["status"] == "duplicate"

    @pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
    def test_bad_input_is_a_problem_and_writes_nothing(
        self, stack: Stack, client: httpx.Client, tenant: str, case: str
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
        self, stack: Stack, client: httpx.Client, tenant: str
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
        nobody = client.post(f"/webhooks/{tenant}/nobody", headers=headers, content=body)
        assert nobody.status_code == 404 and nobody.headers["content-type"] == PROBLEM
        assert stack.inbox(tenant) == [] and stack.count(events, tenant) == before
        polled = client.get(f"/operations/{op_id}", headers={"X-Tenant-Id": tenant})
        assert polled.json()["state"] == "outcome_unknown"

    def test_an_operation_id_no_row_can_hold_is_404(
        self, stack: Stack, client: httpx.Client, tenant: str
    ) -> None:
        for op_id in ("0" * 37, "no-such-operation"):
            missing = client.get(f"/operations/{op_id}", headers={"X-Tenant-Id": tenant})
            assert missing.status_code == 404, missing.text
            assert missing.json()["type"] == "urn:payorch:problem:operation-not-found"

    @pytest.mark.parametrize("forged_first", [False, True], ids=["own-first", "forged-first"])
    def test_a_repeated_signature_line_is_answered_as_fastapi_answers(
        self, stack: Stack, client: httpx.Client, tenant: str, forged_first: bool
    ) -> None:
        reference_tenant = f"{tenant}-fastapi"  # its own operation, settled through FastAPI
        deliveries = []
        for who in (tenant, reference_tenant):
            stack.sandbox.inject("drop_after")
            unknown = post(client, who, "order-5")
            assert unknown.status_code == 202, unknown.text
            deliveries.append(delivery_for(stack, who, unknown.json()["operation_id"]))
        (ours, body), (theirs, reference_body) = deliveries
        served = client.post(
            f"/webhooks/{tenant}/sandbox",
            headers=repeated_signature(ours, forged_first=forged_first),
            content=body,
        )
        reference = fastapi_answer(
            stack,
            reference_tenant,
            repeated_signature(theirs, forged_first=forged_first),
            reference_body,
        )
        # FastAPI hands the sandbox adapter every line; it checks the last one.
        if forged_first:
            assert answer_of(reference) == (200, "application/json", "applied"), reference.text
        else:
            assert answer_of(reference) == (400, PROBLEM, SIGNATURE_INVALID), reference.text
        if forged_first and self.JOINS_REPEATED_HEADER_LINES:
            # The two lines arrive as one value, no signature the adapter can parse: refused,
            # nothing written (FastAPI applied it). docs/integrations.md says so.
            assert answer_of(served) == (400, PROBLEM, SIGNATURE_INVALID), served.text
            assert stack.inbox(tenant) == []
            return
        assert answer_of(served) == answer_of(reference), served.text
        assert stack.inbox(tenant) == stack.inbox(reference_tenant)
