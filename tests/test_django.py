"""Django: the example project served by a real server process (uvicorn/ASGI, and runserver
for WSGI), driven with httpx against the loopback sandbox, on SQLite and PostgreSQL."""

from __future__ import annotations

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
from conftest import DROP_HOLD_SECONDS, Ledger, create_pg_database
from django_server import DjangoServer

from payorch import migrate
from payorch.providers.sandbox import SandboxServer
from payorch.storage._tables import operations, webhook_inbox

pytestmark = pytest.mark.slow

PAYMENT = {"amount": 1999, "currency": "EUR", "customer": "cus_42"}
PROBLEM = "application/problem+json"
# The two views under test: (the payment endpoint, the webhook endpoint's prefix).
VIEWS = {
    "sync": ("/payments", "/payorch/webhooks"),
    "async": ("/async/payments", "/async/webhooks"),
}


@dataclass
class Stack(Ledger):
    url: str  # the Django server
    db_url: str
    sandbox: SandboxServer
    engine: sa.Engine

    def rows(self, tenant: str) -> int:
        query = sa.select(sa.func.count()).where(operations.c.tenant_id == tenant)
        with self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

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
        target = tmp_path_factory.mktemp("django") / "payorch.db"
        shutil.copyfile(template, target)
        return f"sqlite:///{target}"
    url = create_pg_database(request.getfixturevalue("pg_server_url"), "payorch_django")
    migrate.upgrade(url)
    return url


def server_env(db_url: str, sandbox: SandboxServer) -> dict[str, str]:
    return {
        "PAYORCH_DATABASE_URL": db_url,
        "PAYORCH_SANDBOX_URL": sandbox.url,
        "PAYORCH_SANDBOX_WEBHOOK_SECRET": sandbox.webhook_secret,
    }


@pytest.fixture(scope="module")
def stack(module_db: str, acquirer: SandboxServer) -> Iterator[Stack]:
    engine = sa.create_engine(module_db)
    try:
        with DjangoServer(env=server_env(module_db, acquirer)) as server:
            yield Stack(url=server.url, db_url=module_db, sandbox=acquirer, engine=engine)
    finally:
        engine.dispose()


@pytest.fixture(params=sorted(VIEWS))
def view(request: pytest.FixtureRequest) -> tuple[str, str]:
    return VIEWS[request.param]


@pytest.fixture
def tenant() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"  # each test its own tenant: its own rows and effects


@pytest.fixture
def client(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=30.0) as c:
        yield c


def post(
    client: httpx.Client,
    path: str,
    tenant: str,
    key: str | bytes | None,
    body: dict[str, Any] | bytes = PAYMENT,
) -> httpx.Response:
    headers: dict[str, str | bytes] = {"X-Tenant-Id": tenant, "Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, headers=headers, content=content)


def test_fresh_then_replay_is_one_effect(
    stack: Stack, client: httpx.Client, view: tuple[str, str], tenant: str
) -> None:
    first = post(client, view[0], tenant, "order-1")
    assert first.status_code == 201, first.text
    op_id = first.json()["operation_id"]
    assert first.json()["state"] == "succeeded" and "Idempotent-Replayed" not in first.headers
    assert first.headers["Payorch-Operation-Id"] == op_id
    replay = post(client, view[0], tenant, "order-1")
    assert replay.status_code == 201 and replay.content == first.content
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert len(stack.effects_of(tenant, op_id)) == 1 and stack.rows(tenant) == 1
    # The Location names the operation, readable by its tenant only.
    assert first.headers["Location"] == f"/payorch/operations/{op_id}"
    for where in (first.headers["Location"], f"/async/operations/{op_id}"):
        polled = client.get(where, headers={"X-Tenant-Id": tenant})
        assert polled.status_code == 200 and polled.json()["state"] == "succeeded"
        other = client.get(where, headers={"X-Tenant-Id": f"{tenant}-x"})
        assert other.status_code == 404 and other.headers["Content-Type"] == PROBLEM


def test_twenty_concurrent_duplicates_make_one_effect(
    stack: Stack, client: httpx.Client, view: tuple[str, str], tenant: str
) -> None:
    with stack.sandbox.hold_commits() as gate, ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(post, client, view[0], tenant, "dup-1") for _ in range(20)]
        assert gate.wait_held(1, timeout=30)  # one request is at the provider, held there
        # The other 19 find it in progress and are answered while it is held.
        early = [f.result() for f in islice(as_completed(futures, timeout=60), 19)]
        gate.release()
        answers = [f.result(timeout=60) for f in futures]
    assert [r.status_code for r in early] == [409] * 19
    statuses = Counter(r.status_code for r in answers)
    assert statuses[201] == 1 and statuses[409] == 19, statuses
    for refused in (r for r in answers if r.status_code == 409):
        assert refused.headers["Content-Type"] == PROBLEM
        assert refused.json()["type"] == "urn:payorch:problem:operation-in-progress"
        assert int(refused.headers["Retry-After"]) >= 1
    assert len(stack.effects(tenant)) == 1 and stack.rows(tenant) == 1


def test_a_changed_amount_under_the_key_is_422(
    stack: Stack, client: httpx.Client, view: tuple[str, str], tenant: str
) -> None:
    assert post(client, view[0], tenant, "order-2").status_code == 201
    changed = post(client, view[0], tenant, "order-2", {**PAYMENT, "amount": 2999})
    assert changed.status_code == 422 and changed.headers["Content-Type"] == PROBLEM
    assert changed.json()["type"] == "urn:payorch:problem:idempotency-key-reused"
    assert len(stack.effects(tenant)) == 1 and stack.rows(tenant) == 1


def test_quoted_and_bare_keys_are_one_operation(
    stack: Stack, client: httpx.Client, view: tuple[str, str], tenant: str
) -> None:
    quoted = post(client, view[0], tenant, '"8e03978e-40d5-43e8-bc93-6894a57f9324"')
    bare = post(client, view[0], tenant, "8e03978e-40d5-43e8-bc93-6894a57f9324")
    assert quoted.status_code == bare.status_code == 201
    assert bare.json()["operation_id"] == quoted.json()["operation_id"]
    assert bare.headers["Idempotent-Replayed"] == "true"
    assert len(stack.effects(tenant)) == 1 and stack.rows(tenant) == 1


@pytest.mark.parametrize(
    ("key", "body", "status", "problem"),
    [
        (None, PAYMENT, 400, "invalid-idempotency-key"),  # missing
        ("a, b", PAYMENT, 400, "invalid-idempotency-key"),  # list-valued
        ('"a", "b"', PAYMENT, 400, "invalid-idempotency-key"),
        ("caf\u00e9".encode(), PAYMENT, 400, "invalid-idempotency-key"),  # non-ASCII
        ('"abc', PAYMENT, 400, "invalid-idempotency-key"),  # badly quoted
        ("k-1", b"{not json", 400, "request-body-not-json"),
        ("k-1", b'{"amount": 1, "amount": 2}', 400, "request-body-not-json"),
        ("k-1", b"[1, 2]", 422, "request-validation-failed"),
        ("k-1", {"amount": -5, "currency": "EUR"}, 422, "request-validation-failed"),
    ],
)
def test_bad_input_is_a_problem_and_writes_nothing(
    stack: Stack,
    client: httpx.Client,
    view: tuple[str, str],
    tenant: str,
    key: str | bytes | None,
    body: dict[str, Any] | bytes,
    status: int,
    problem: str,
) -> None:
    refused = post(client, view[0], tenant, key, body)
    assert refused.status_code == status, refused.text
    assert refused.headers["Content-Type"] == PROBLEM
    assert refused.json()["type"] == f"urn:payorch:problem:{problem}"
    assert stack.rows(tenant) == 0 and stack.effects(tenant) == []


def test_the_tenant_comes_from_the_request_never_the_body(
    stack: Stack, client: httpx.Client, view: tuple[str, str], tenant: str
) -> None:
    body = json.dumps({**PAYMENT, "tenant_id": "someone-else"}).encode()
    headers = {"Idempotency-Key": "k-1", "Content-Type": "application/json"}
    missing = client.post(view[0], headers=headers, content=body)
    assert missing.status_code == 400 and missing.headers["Content-Type"] == PROBLEM
    assert missing.json()["type"] == "urn:payorch:problem:invalid-tenant"
    bad = client.post(view[0], headers={**headers, "X-Tenant-Id": "no spaces"}, content=body)
    assert bad.status_code == 400 and bad.json()["type"] == "urn:payorch:problem:invalid-tenant"
    assert stack.rows("someone-else") == 0
    not_post = client.get(view[0], headers={"X-Tenant-Id": tenant})
    assert not_post.status_code == 405 and not_post.headers["Allow"] == "POST"
    assert not_post.headers["Content-Type"] == PROBLEM
    assert stack.rows(tenant) == 0


def test_a_dropped_answer_is_202_until_a_signed_webhook_settles_it(
    stack: Stack, client: httpx.Client, view: tuple[str, str], tenant: str
) -> None:
    stack.sandbox.inject("drop_after")
    unknown = post(client, view[0], tenant, "order-3")
    assert unknown.status_code == 202, unknown.text
    op_id = unknown.json()["operation_id"]
    assert unknown.json()["state"] == "outcome_unknown"
    assert unknown.json()["retry"] == "same_key"
    assert unknown.headers["Location"].endswith(f"/operations/{op_id}")
    again = post(client, view[0], tenant, "order-3")
    assert again.status_code == 202 and again.json()["operation_id"] == op_id
    assert len(stack.effects_of(tenant, op_id)) == 1  # committed there, answer dropped

    key = stack.downstream_key(tenant, op_id).encode()  # what the effect carries
    (delivery,) = [d for d in stack.sandbox.webhook_deliveries() if key in d.body]
    hook = f"{view[1]}/{tenant}/sandbox"
    forged = {
        **delivery.headers,
        "webhook-signature": "v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
    }
    refused = client.post(hook, headers=forged, content=delivery.body)
    assert refused.status_code == 400 and refused.headers["Content-Type"] == PROBLEM
    assert refused.json()["type"] == "urn:payorch:problem:webhook-signature-invalid"
    assert stack.inbox(tenant) == []
    assert post(client, view[0], tenant, "order-3").status_code == 202  # still unknown

    applied = client.post(hook, headers=delivery.headers, content=delivery.body)
    assert applied.status_code == 200, applied.text
    assert applied.json()["status"] == "applied" and applied.json()["operation_id"] == op_id
    duplicate = client.post(hook, headers=delivery.headers, content=delivery.body)
    assert duplicate.status_code == 200 and duplicate.json()["status"] == "duplicate"
    assert stack.inbox(tenant) == ["applied"]

    settled = post(client, view[0], tenant, "order-3")
    assert settled.status_code == 201 and settled.json()["state"] == "succeeded"
    assert settled.json()["operation_id"] == op_id
    assert settled.headers["Idempotent-Replayed"] == "true"
    assert len(stack.effects_of(tenant, op_id)) == 1 and stack.rows(tenant) == 1


def test_runserver_serves_sync_views_and_refuses_async_ones(
    tmp_path: Path, sqlite_template: Path, sandbox: SandboxServer
) -> None:
    # WSGI (runserver): sync views work; an async view would get an event loop per
    # request, which the async store cannot share, so it is refused before anything runs.
    target = tmp_path / "payorch.db"
    shutil.copyfile(sqlite_template, target)
    db_url = f"sqlite:///{target}"
    engine = sa.create_engine(db_url)
    with (
        DjangoServer(env=server_env(db_url, sandbox), asgi=False) as server,
        httpx.Client(base_url=server.url, timeout=30.0) as c,
    ):
        stack = Stack(url=server.url, db_url=db_url, sandbox=sandbox, engine=engine)
        first = post(c, "/payments", "shop", "order-1")
        replay = post(c, "/payments", "shop", "order-1")
        assert first.status_code == replay.status_code == 201
        assert replay.content == first.content and replay.headers["Idempotent-Replayed"] == "true"
        refused = post(c, "/async/payments", "other", "order-1")
        assert refused.status_code == 500 and refused.headers["Content-Type"] == PROBLEM
        assert refused.json()["type"] == "urn:payorch:problem:configuration-error"
        assert stack.rows("shop") == 1 and stack.rows("other") == 0
        assert len(stack.effects("shop")) == 1 and stack.effects("other") == []
    engine.dispose()


# -- in-process: settings and tenant resolvers (no server, no database) --------------------


@dataclass
class FakeUser:
    is_authenticated: bool
    pk: int = 7
    org: Any = None


@pytest.fixture(scope="module")
def rf() -> Any:
    import django
    from django.conf import settings
    from django.test import RequestFactory

    if not settings.configured:
        settings.configure(ALLOWED_HOSTS=["testserver"], USE_TZ=True)
        django.setup()
    return RequestFactory()


def resolve_tenant_from_test(request: Any) -> str:
    return "from-callable"


def test_tenant_resolvers_read_the_request_only(rf: Any) -> None:
    from django.urls import ResolverMatch

    from payorch.errors import ConfigurationError, InvalidTenant
    from payorch.integrations.django import tenant_resolver

    request = rf.post("/p", data=b"{}", content_type="application/json", HTTP_X_TENANT_ID="t-1")
    assert tenant_resolver("header:X-Tenant-Id")(request) == "t-1"
    with pytest.raises(InvalidTenant, match="X-Shop header is missing"):
        tenant_resolver("header:X-Shop")(request)
    request.resolver_match = ResolverMatch(lambda r: None, (), {"shop": "s-9"})
    assert tenant_resolver("kwarg:shop")(request) == "s-9"
    request.user = FakeUser(is_authenticated=False)
    assert tenant_resolver("user")(request) is None  # the view answers 401
    request.user = FakeUser(is_authenticated=True, org=FakeUser(True, pk=3, org="acme"))
    assert tenant_resolver("user")(request) == "7"
    assert tenant_resolver("user:org.org")(request) == "acme"
    assert tenant_resolver(f"{__name__}.resolve_tenant_from_test")(request) == "from-callable"
    for bad in ("header", "body:tenant", "nope"):
        with pytest.raises(ConfigurationError):
            tenant_resolver(bad)


def test_settings_are_checked_and_refusals_are_problems(rf: Any) -> None:
    from django.test import override_settings

    from payorch.errors import ConfigurationError
    from payorch.integrations.django import PayorchConfig, idempotent
    from payorch.providers.sandbox import SandboxProvider

    typo = {"PROVIDERS": [], "TENNANT": "user"}
    with override_settings(PAYORCH=typo), pytest.raises(ConfigurationError, match="unknown"):
        PayorchConfig.from_settings()
    no_providers = {"TENANT": "user"}
    with override_settings(PAYORCH=no_providers), pytest.raises(ConfigurationError):
        PayorchConfig.from_settings()
    with pytest.raises(ConfigurationError, match="200 or 201"):
        idempotent("payment.create", status=202)

    @idempotent("payment.create", status=201)
    def create(request: Any, payload: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("never called without a tenant")

    with SandboxProvider(base_url="http://127.0.0.1:9") as provider:
        payorch = {"PROVIDERS": [provider], "TENANT": "user", "DATABASE_URL": "sqlite://"}
        with override_settings(PAYORCH=payorch):
            request = rf.post("/p", data=b"{}", content_type="application/json")
            request.user = FakeUser(is_authenticated=False)
            answer = create(request)
            assert answer.status_code == 401 and answer["Content-Type"] == PROBLEM
            assert json.loads(answer.content)["type"] == "urn:payorch:problem:tenant-unresolved"
            assert create(rf.get("/p")).status_code == 405
        payorch = {**payorch, "TENANT": "header:X-Tenant-Id"}
        with override_settings(PAYORCH=payorch, DATA_UPLOAD_MAX_MEMORY_SIZE=10):
            big = json.dumps(PAYMENT).encode()
            request = rf.post("/p", data=big, content_type="application/json")
            request.META.update(HTTP_X_TENANT_ID="t-1", HTTP_IDEMPOTENCY_KEY="k-1")
            answer = create(request)
            assert answer.status_code == 413 and answer["Content-Type"] == PROBLEM
