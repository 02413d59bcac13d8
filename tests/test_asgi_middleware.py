"""The ASGI middleware around a plain ASGI app and around a Starlette app, each served by a
real uvicorn process (tests/asgi_server.py), driven with httpx against the loopback sandbox,
on SQLite and PostgreSQL; its routing and lifespan on an app in this process."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from conftest import DROP_HOLD_SECONDS, FAST_TIMEOUT
from served_contract import PAYMENT, PROBLEM, ServedContract, Stack, database, post, served_env
from server_process import ServerProcess, refused_start, uvicorn_command
from starlette.datastructures import Headers

from payorch.errors import ConfigurationError
from payorch.integrations._common import WebhookHeaders
from payorch.integrations.asgi import (
    Message,
    OperationRoute,
    PayorchMiddleware,
    Receive,
    Scope,
    Send,
)
from payorch.providers.sandbox import SandboxProvider, SandboxServer

pytestmark = pytest.mark.slow

APPS = {"plain": "asgi_server:plain_app", "starlette": "asgi_server:starlette_app"}


@pytest.fixture(scope="module")
def acquirer() -> Iterator[SandboxServer]:
    # drop_hold: a dropped answer holds the socket, then closes it: the call is ambiguous.
    with SandboxServer(drop_hold_seconds=DROP_HOLD_SECONDS) as sb:
        yield sb


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def module_db(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    yield from database(request, tmp_path_factory.mktemp("asgi"), "payorch_asgi")


@pytest.fixture(scope="module", params=sorted(APPS))
def app_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def events_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("asgi-events") / "events"


@pytest.fixture(scope="module")
def stack(
    module_db: str, app_name: str, acquirer: SandboxServer, events_file: Path
) -> Iterator[Stack]:
    env = {**served_env(module_db, acquirer), "ASGI_TEST_EVENTS": str(events_file)}
    engine = sa.create_engine(module_db)
    try:
        with ServerProcess(uvicorn_command(APPS[app_name], factory=True), env=env) as server:
            yield Stack(url=server.url, sandbox=acquirer, engine=engine)
        if app_name == "starlette":  # the app got the lifespan events through payorch
            assert events_file.read_text() == "started\nstopped\n"
    finally:
        engine.dispose()


class TestServedByUvicorn(ServedContract):
    """The contract (tests/served_contract.py), over the uvicorn process, for both apps."""

    def test_everything_else_is_the_apps(
        self, stack: Stack, client: httpx.Client, tenant: str, app_name: str
    ) -> None:
        listing = client.get("/payments")  # GET: not a payorch route
        if app_name == "starlette":
            assert listing.status_code == 200 and listing.json()["app"] == "starlette"
        else:
            assert listing.status_code == 404 and listing.json()["app"] == "plain"
        deeper = client.post(f"/webhooks/{tenant}/sandbox/extra", content=b"{}")
        assert deeper.status_code == 404 and deeper.headers["content-type"] != PROBLEM
        assert stack.rows(tenant) == 0

    def test_a_wrong_method_on_payorchs_prefixes_is_405(
        self, stack: Stack, client: httpx.Client, tenant: str
    ) -> None:
        for method, path, allowed in (
            ("GET", f"/webhooks/{tenant}/sandbox", "POST"),
            ("POST", "/operations/some-id", "GET, HEAD"),
        ):
            refused = client.request(method, path, headers={"X-Tenant-Id": tenant})
            assert refused.status_code == 405 and refused.headers["Allow"] == allowed
            assert refused.json()["type"] == "urn:payorch:problem:method-not-allowed"

    def test_head_of_an_operation_has_no_body(
        self, stack: Stack, client: httpx.Client, tenant: str
    ) -> None:
        op_id = post(client, tenant, "head-1").json()["operation_id"]
        head = client.head(f"/operations/{op_id}", headers={"X-Tenant-Id": tenant})
        assert head.status_code == 200 and head.content == b""
        assert head.headers["Payorch-Operation-Id"] == op_id


@pytest.fixture(params=["sqlite", "postgres"])
def empty_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield from database(request, tmp_path, "payorch_asgi_empty", migrated=False)


@pytest.mark.parametrize("app", sorted(APPS))
def test_an_unmigrated_database_refuses_to_start_with_the_upgrade_hint(
    empty_db: str, sandbox: SandboxServer, app: str, tmp_path: Path
) -> None:
    events = tmp_path / "events"
    env = {**served_env(empty_db, sandbox), "ASGI_TEST_EVENTS": str(events)}
    done = refused_start(uvicorn_command(APPS[app], factory=True), env=env)
    assert done.returncode != 0
    assert "payorch cannot start" in done.stderr and "payorch db upgrade" in done.stderr
    assert "Traceback" not in done.stderr  # one line to act on
    assert not events.exists()  # the app never started: payorch refused first


# -- routing and lifespan on an app in this process ----------------------------------------


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    target = tmp_path / "payorch.db"
    shutil.copyfile(sqlite_template, target)
    return f"sqlite:///{target}"


class Lifespan:
    """Drives the ``lifespan`` protocol as a server does; records what the app sent."""

    def __init__(self, app: PayorchMiddleware) -> None:
        self.app = app
        self.sent: list[str] = []
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()

    async def receive(self) -> Message:
        return await self.inbox.get()

    async def send(self, message: Message) -> None:
        self.sent.append(message["type"])

    async def run(self) -> list[str]:
        task = asyncio.create_task(self.app({"type": "lifespan"}, self.receive, self.send))
        await self.inbox.put({"type": "lifespan.startup"})
        await self.inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(task, 30)
        return self.sent


def middleware(inner: Any, url: str, sandbox: SandboxServer, **kw: Any) -> PayorchMiddleware:
    adapter = SandboxProvider(
        base_url=sandbox.url, webhook_secret=sandbox.webhook_secret, timeout=FAST_TIMEOUT
    )
    routes = {("POST", "/payments"): OperationRoute("payment.create", status_code=201)}
    return PayorchMiddleware(inner, url=url, providers=[adapter], routes=routes, **kw)


def test_lifespan_reaches_the_app_and_closes_last(sqlite_url: str, sandbox: SandboxServer) -> None:
    seen: list[str] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "lifespan"
        while True:  # bounded: the driver sends startup, then shutdown
            message = await receive()
            seen.append(message["type"])
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return

    app = middleware(inner, sqlite_url, sandbox)
    sent = asyncio.run(Lifespan(app).run())
    assert seen == ["lifespan.startup", "lifespan.shutdown"]
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert app._closed  # payorch closed its store once the app was done


def test_an_app_without_lifespan_still_gets_payorchs(
    sqlite_url: str, sandbox: SandboxServer
) -> None:
    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError(f"only http here, not {scope['type']}")

    app = middleware(inner, sqlite_url, sandbox)
    sent = asyncio.run(Lifespan(app).run())
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def test_a_root_path_is_stripped_and_named_in_location(
    sqlite_url: str, sandbox: SandboxServer
) -> None:
    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError(f"payorch's route went to the app: {scope['path']}")

    app = middleware(inner, sqlite_url, sandbox)

    async def scenario() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, root_path="/shop")
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            headers = {"Idempotency-Key": "r-1", "X-Tenant-Id": "shop-a"}
            answer = await client.post("/shop/payments", headers=headers, json=PAYMENT)
        await app.shutdown()
        return answer

    answer = asyncio.run(scenario())
    assert answer.status_code == 201, answer.text
    assert answer.headers["Location"] == f"/shop/operations/{answer.json()['operation_id']}"


def test_an_unexpected_error_is_a_500_that_says_same_key_and_is_logged(
    sqlite_url: str, sandbox: SandboxServer, caplog: pytest.LogCaptureFixture
) -> None:
    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("payorch's route went to the app")

    def broken_resolver(scope: Scope) -> str | None:
        raise RuntimeError("the session store is down")

    app = middleware(inner, sqlite_url, sandbox, tenant=broken_resolver)

    async def scenario() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            answer = await client.post("/payments", headers={"Idempotency-Key": "e-1"}, json={})
        await app.shutdown()
        return answer

    answer = asyncio.run(scenario())
    assert answer.status_code == 500 and answer.headers["content-type"] == PROBLEM
    assert answer.json()["retry"] == "same_key" and "session" not in answer.text
    logged = [r for r in caplog.records if r.name == "payorch.asgi"]
    assert [r.levelname for r in logged] == ["ERROR"] and logged[0].exc_info is not None


def test_configuration_is_refused_at_once(sqlite_url: str, sandbox: SandboxServer) -> None:
    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        return None

    with pytest.raises(ConfigurationError, match="200 or 201"):
        OperationRoute("payment.create", status_code=202)
    with pytest.raises(ConfigurationError, match="prefix"):
        middleware(inner, sqlite_url, sandbox, webhooks="/hooks/")
    with pytest.raises(ConfigurationError, match="max_body"):
        middleware(inner, sqlite_url, sandbox, max_body=0)


def test_the_middleware_needs_no_framework() -> None:
    code = (
        "import sys, payorch.integrations.asgi;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('starlette', 'fastapi', 'flask', 'django', 'uvicorn')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_webhook_headers_are_what_fastapi_hands_the_adapters() -> None:
    # FastAPI hands the adapters Starlette's Headers; Flask and the middleware, these.
    lines = [
        (b"webhook-id", b"msg_1"),
        (b"webhook-signature", b"v1,first"),
        (b"Webhook-Signature", b"v1,second"),
        (b"content-type", b"application/json"),
    ]
    theirs = Headers(raw=[(k.lower(), v) for k, v in lines])
    ours = WebhookHeaders((k.decode("latin-1"), v.decode("latin-1")) for k, v in lines)
    assert list(ours.items()) == list(theirs.items())  # every line, names lower-cased
    assert list(ours.keys()) == list(theirs.keys()) and list(ours.values()) == list(theirs.values())
    assert len(ours) == len(theirs) == 4
    assert ours["WEBHOOK-SIGNATURE"] == theirs["WEBHOOK-SIGNATURE"] == "v1,first"
    assert ours.getlist("webhook-signature") == theirs.getlist("webhook-signature")
    assert dict(ours.items()) == dict(theirs.items())  # a dict of the lines keeps the last
    assert dict(ours) == dict(theirs)  # a dict of the mapping keeps the first
    assert "Webhook-Id" in ours and "webhook-timestamp" not in ours and ours.get("x") is None
