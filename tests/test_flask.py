"""Flask: an app with payorch's extension served by a real WSGI server process (werkzeug,
threaded; tests/flask_server.py), driven with httpx against the loopback sandbox, on SQLite
and PostgreSQL; the extension's own choices on an app in this process."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from conftest import DROP_HOLD_SECONDS, FAST_TIMEOUT
from flask import Flask
from served_contract import (
    PAYMENT,
    PROBLEM,
    ServedContract,
    Stack,
    database,
    delivery_for,
    post,
    served_env,
)
from server_process import TESTS, ServerProcess, refused_start, script_command

from payorch.errors import ConfigurationError, SchemaNotReady
from payorch.integrations.flask import Idempotent, Payorch, header_tenant, path_tenant
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.storage._tables import operations

pytestmark = pytest.mark.slow

SERVER = script_command(TESTS / "flask_server.py")


@pytest.fixture(scope="module")
def acquirer() -> Iterator[SandboxServer]:
    # drop_hold: a dropped answer holds the socket, then closes it: the call is ambiguous.
    with SandboxServer(drop_hold_seconds=DROP_HOLD_SECONDS) as sb:
        yield sb


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def module_db(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    yield from database(request, tmp_path_factory.mktemp("flask"), "payorch_flask")


@pytest.fixture(scope="module")
def stack(module_db: str, acquirer: SandboxServer) -> Iterator[Stack]:
    engine = sa.create_engine(module_db)
    try:
        with ServerProcess(SERVER, env=served_env(module_db, acquirer)) as server:
            yield Stack(url=server.url, sandbox=acquirer, engine=engine)
    finally:
        engine.dispose()


AUDIT = ("X-Audit", "read-body")  # tests/flask_server.py's before_request hook reads the body


class TestServedByWerkzeug(ServedContract):
    """The contract (tests/served_contract.py), over the WSGI server process."""

    JOINS_REPEATED_HEADER_LINES = True

    def test_a_hook_that_read_the_body_first_leaves_it_to_payorch(
        self, stack: Stack, client: httpx.Client, tenant: str
    ) -> None:
        stack.sandbox.inject("drop_after")
        unknown = post(client, tenant, "audited-1", extra=[AUDIT])
        assert unknown.status_code == 202, unknown.text
        sent = json.dumps(PAYMENT).encode()
        assert unknown.headers["X-Audited-Sha256"] == hashlib.sha256(sent).hexdigest()
        op_id = unknown.json()["operation_id"]
        headers, body = delivery_for(stack, tenant, op_id)
        hook = client.post(
            f"/webhooks/{tenant}/sandbox", headers=[*headers.items(), AUDIT], content=body
        )
        assert hook.status_code == 200 and hook.json()["status"] == "applied", hook.text
        assert hook.headers["X-Audited-Sha256"] == hashlib.sha256(body).hexdigest()
        paid = post(client, tenant, "audited-2", extra=[AUDIT])
        assert paid.status_code == 201 and paid.json()["state"] == "succeeded", paid.text
        assert stack.inbox(tenant) == ["applied"] and len(stack.effects(tenant)) == 2

    @pytest.mark.parametrize("audited", [False, True], ids=["alone", "after-a-hook"])
    def test_a_chunked_body_is_read_within_max_body(
        self, stack: Stack, client: httpx.Client, tenant: str, audited: bool
    ) -> None:
        headers = [("Content-Type", "application/json"), ("X-Tenant-Id", tenant)]
        headers += [AUDIT] if audited else []

        def chunked(key: str, body: bytes) -> httpx.Response:
            # An iterator has no length: httpx sends it chunked, without a Content-Length.
            lines = [*headers, ("Idempotency-Key", key)]
            return client.post("/payments", headers=lines, content=iter([body]))

        paid = chunked("chunked-1", json.dumps(PAYMENT).encode())
        assert paid.status_code == 201 and paid.json()["state"] == "succeeded", paid.text
        huge = chunked("chunked-2", b" " * ((1 << 20) + 1))
        assert huge.status_code == 413, huge.text
        assert huge.json()["type"] == "urn:payorch:problem:request-body-too-large"
        assert stack.rows(tenant) == 1 and len(stack.effects(tenant)) == 1

    def test_a_view_that_aborts_keeps_its_status_and_runs_nothing(
        self, stack: Stack, client: httpx.Client, tenant: str
    ) -> None:
        refused = post(client, tenant, "guarded-1", path="/guarded")
        assert refused.status_code == 403, refused.text
        assert stack.rows(tenant) == 0 and stack.effects(tenant) == []


@pytest.fixture(params=["sqlite", "postgres"])
def empty_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield from database(request, tmp_path, "payorch_flask_empty", migrated=False)


def test_an_unmigrated_database_refuses_to_start_with_the_upgrade_hint(
    empty_db: str, sandbox: SandboxServer
) -> None:
    done = refused_start(SERVER, env=served_env(empty_db, sandbox))
    assert done.returncode != 0
    assert "SchemaNotReady" in done.stderr and "payorch db upgrade" in done.stderr


# -- the extension on an app in this process ---------------------------------------------------


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    target = tmp_path / "payorch.db"
    shutil.copyfile(sqlite_template, target)
    return f"sqlite:///{target}"


def test_tenant_from_the_url_and_its_location(
    sqlite_url: str, sandbox: SandboxServer, caplog: pytest.LogCaptureFixture
) -> None:
    adapter = SandboxProvider(
        base_url=sandbox.url, webhook_secret=sandbox.webhook_secret, timeout=FAST_TIMEOUT
    )
    app = Flask(__name__)
    payorch = Payorch(app, url=sqlite_url, providers=[adapter], tenant=path_tenant("tenant"))
    app.register_blueprint(payorch.blueprint(operations="/t/<tenant>/operations"))

    @app.post("/t/<tenant>/payments")
    @payorch.operation("payment.create", status_code=201)
    def by_path(op: Idempotent, tenant: str) -> object:
        assert op.tenant == tenant
        return op.run()

    app.add_url_rule("/payments", view_func=payorch.endpoint("payment.create"), methods=["POST"])
    client = app.test_client()
    key = {"Idempotency-Key": "p-1"}
    first = client.post("/t/shop-a/payments", headers=key, json=PAYMENT)
    assert first.status_code == 201, first.text
    op_id = first.json["operation_id"]  # type: ignore[index]
    assert first.headers["Location"] == f"/t/shop-a/operations/{op_id}"
    # The same key under another tenant is another operation.
    other = client.post("/t/shop-b/payments", headers=key, json=PAYMENT)
    assert other.status_code == 201 and other.json["operation_id"] != op_id  # type: ignore[index]
    assert client.get(first.headers["Location"]).status_code == 200
    theirs = client.get(f"/t/shop-b/operations/{op_id}")
    assert theirs.status_code == 404 and theirs.content_type == PROBLEM
    # A rule without <tenant>: the app's mistake, a 500 that says "same key".
    broken = client.post("/payments", headers={"Idempotency-Key": "p-2"}, json=PAYMENT)
    assert broken.status_code == 500 and broken.json["retry"] == "same_key"  # type: ignore[index]
    assert [r.levelname for r in caplog.records if r.name == "payorch.flask"] == ["ERROR"]
    payorch.close()
    engine = sa.create_engine(sqlite_url)
    with engine.connect() as conn:
        tenants = sorted(r.tenant_id for r in conn.execute(sa.select(operations.c.tenant_id)))
    engine.dispose()
    assert tenants == ["shop-a", "shop-b"]


def test_header_tenant_is_400_when_missing_and_the_app_limit_is_413(
    sqlite_url: str, sandbox: SandboxServer
) -> None:
    adapter = SandboxProvider(base_url=sandbox.url, webhook_secret=sandbox.webhook_secret)
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = 100  # the app's own limit, below payorch's
    payorch = Payorch(url=sqlite_url, providers=[adapter], tenant=header_tenant("X-Shop"))
    payorch.init_app(app)
    app.add_url_rule("/payments", view_func=payorch.endpoint("payment.create"), methods=["POST"])
    client = app.test_client()
    missing = client.post("/payments", headers={"Idempotency-Key": "h-1"}, json=PAYMENT)
    assert missing.status_code == 400 and missing.content_type == PROBLEM
    assert missing.json["type"] == "urn:payorch:problem:invalid-tenant"  # type: ignore[index]
    big = {**PAYMENT, "description": "x" * 200}
    headers = {"Idempotency-Key": "h-2", "X-Shop": "shop-a"}
    too_large = client.post("/payments", headers=headers, json=big)
    assert too_large.status_code == 413, too_large.text
    assert too_large.json["type"] == "urn:payorch:problem:request-body-too-large"  # type: ignore[index]
    assert client.post("/payments", headers=headers, json=PAYMENT).status_code == 200
    assert app.extensions["payorch"] is payorch
    payorch.close()


def test_configuration_is_refused_at_once(
    sqlite_url: str, sandbox: SandboxServer, tmp_path: Path
) -> None:
    adapter = SandboxProvider(base_url=sandbox.url, webhook_secret=sandbox.webhook_secret)
    with pytest.raises(ConfigurationError, match="url or a store"):
        Payorch(providers=[adapter], url=sqlite_url, store=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="at least one provider"):
        Payorch(providers=[], url=sqlite_url)
    payorch = Payorch(providers=[adapter], url=sqlite_url)
    with pytest.raises(ConfigurationError, match="200 or 201"):
        payorch.operation("payment.create", status_code=202)
    payorch.close()
    # An app factory against an empty database stops at init_app, with the command to run.
    empty = Payorch(providers=[adapter], url=f"sqlite:///{tmp_path / 'empty.db'}")
    with pytest.raises(SchemaNotReady, match="payorch db upgrade"):
        empty.init_app(Flask(__name__))
    empty.close()


def test_the_core_never_imports_flask() -> None:
    code = (
        "import sys, payorch, payorch.execution._executor, payorch.http, payorch.integrations;"
        "import payorch.integrations.asgi;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flask', 'werkzeug')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
