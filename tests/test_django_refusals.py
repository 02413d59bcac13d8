"""Django: a view that refuses the Django way keeps its status, and the start-up check.

``PermissionDenied``, ``Http404``, ``SuspiciousOperation`` (and ``DisallowedHost``) and
``BadRequest`` raised by an ``@idempotent`` view answer 403/404/400 as problem+json, logged
below ERROR by payorch (a ``SuspiciousOperation`` at ERROR to ``django.security.<class>``, as
Django does), with nothing stored under the key: the same key, sent again once the request
is fixed, runs once. Raised on the retry of a key that already succeeded, the refusal does
not claim that nothing is stored, changes nothing, and the next retry replays. A database
without payorch's schema answers 503 ``schema-not-ready`` until it is upgraded, one request
checking at a time. Sync and async views, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import LoopThread

from payorch import migrate
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.storage._tables import operations

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}
PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def django_ready() -> None:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(ALLOWED_HOSTS=["testserver"], USE_TZ=True)
        django.setup()


def refusal(name: str) -> Exception:
    from django.core.exceptions import (
        BadRequest,
        DisallowedHost,
        PermissionDenied,
        SuspiciousOperation,
    )
    from django.http import Http404

    kinds: dict[str, Callable[[str], Exception]] = {
        "PermissionDenied": PermissionDenied,
        "Http404": Http404,
        "SuspiciousOperation": SuspiciousOperation,
        "DisallowedHost": DisallowedHost,
        "BadRequest": BadRequest,
    }
    return kinds[name]("the view's own words")


# (what the view raises, the status, the problem type's last part)
REFUSALS = [
    ("PermissionDenied", 403, "permission-denied"),
    ("Http404", 404, "not-found"),
    ("SuspiciousOperation", 400, "suspicious-request"),
    ("DisallowedHost", 400, "suspicious-request"),
    ("BadRequest", 400, "bad-request"),
]


def views() -> dict[str, Callable[..., Any]]:
    from payorch.integrations.django import idempotent

    @idempotent("payment.create", status=201)
    def sync_view(request: Any, payload: dict[str, Any]) -> dict[str, Any]:
        refuse = request.headers.get("X-Refuse")
        if refuse:  # e.g. the caller may not pay for this order (yet)
            raise refusal(refuse)
        return payload

    @idempotent("payment.create", status=201)
    async def async_view(request: Any, payload: dict[str, Any]) -> dict[str, Any]:
        refuse = request.headers.get("X-Refuse")
        if refuse:
            raise refusal(refuse)
        return payload

    return {"sync": sync_view, "async": async_view}


class Caller:
    """Calls one view the way its server would: sync in this thread, async on the loop."""

    def __init__(self, mode: str, loop: LoopThread) -> None:
        from django.test import AsyncRequestFactory, RequestFactory

        self.mode, self.loop = mode, loop
        self.view = views()[mode]
        self.factory = AsyncRequestFactory() if mode == "async" else RequestFactory()

    def post(self, tenant: str, key: str, refuse: str | None = None) -> Any:
        headers = {"X-Tenant-Id": tenant, "Idempotency-Key": key}
        if refuse is not None:
            headers["X-Refuse"] = refuse
        request = self.factory.post(
            "/payments", data=json.dumps(PAYMENT), content_type="application/json", headers=headers
        )
        if self.mode == "async":
            return self.loop.run(self.view(request))
        return self.view(request)

    def close(self, provider: SandboxProvider) -> None:
        if self.mode != "async":
            return
        from payorch.integrations.django import async_store

        async def close() -> None:  # the async store's pool belongs to the loop
            await async_store().close()
            await provider.aclose()

        self.loop.run(close())


def rows(db_url: str, tenant: str) -> int:
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            query = sa.select(sa.func.count()).where(operations.c.tenant_id == tenant)
            return int(conn.execute(query).scalar_one())
    finally:
        engine.dispose()


def row(db_url: str, tenant: str) -> dict[str, Any]:
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            query = sa.select(operations).where(operations.c.tenant_id == tenant)
            return dict(conn.execute(query).mappings().one())
    finally:
        engine.dispose()


def says_what_is_true(detail: str) -> None:
    """A view's refusal comes before payorch looks at the key: it never says what the key
    holds, and never invites a new one."""
    assert "nothing was stored" not in detail and "nothing ran" not in detail
    assert "before payorch looked at its idempotency key" in detail
    assert "this request started nothing" in detail
    assert "an earlier request with the same key may have run" in detail
    assert "retry the same key, or GET the operation" in detail
    assert "never use a new key for the same payment" in detail


def effects(sandbox: SandboxServer, tenant: str) -> list[dict[str, Any]]:
    return [e for e in sandbox.ledger() if e["metadata"].get("payorch_tenant_id") == tenant]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize(("raised", "status", "kind"), REFUSALS)
def test_a_django_refusal_keeps_its_status_and_leaves_the_key_unused(
    django_ready: None,
    db_url: str,
    sandbox: SandboxServer,
    sandbox_provider: SandboxProvider,
    loop_thread: LoopThread,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    raised: str,
    status: int,
    kind: str,
) -> None:
    from django.test import override_settings

    tenant, key = f"t-{uuid.uuid4().hex[:10]}", f"k-{uuid.uuid4().hex}"
    caller = Caller(mode, loop_thread)
    settings = {
        "PROVIDERS": [sandbox_provider],
        "TENANT": "header:X-Tenant-Id",
        "OPERATION_URL": None,
    }
    with override_settings(PAYORCH={**settings, "DATABASE_URL": db_url}):
        try:
            with caplog.at_level(logging.INFO, logger="payorch"):
                refused = caller.post(tenant, key, refuse=raised)
            assert refused.status_code == status
            assert refused["Content-Type"] == PROBLEM
            body = json.loads(refused.content)
            assert body["type"] == f"urn:payorch:problem:{kind}"
            assert body["status"] == status
            says_what_is_true(body["detail"])
            assert "the view's own words" not in body["detail"]
            assert "retry" not in body  # not a 5xx: nothing to come back for unchanged
            ours = [r for r in caplog.records if r.name.startswith("payorch")]
            assert ours and all(r.levelno < logging.ERROR for r in ours)
            security = [r for r in caplog.records if r.name.startswith("django.security")]
            if raised in ("SuspiciousOperation", "DisallowedHost"):  # Django's convention
                assert [(r.name, r.levelno) for r in security] == [
                    (f"django.security.{raised}", logging.ERROR)
                ]
                assert security[0].getMessage() == "the view's own words"
            else:
                assert security == []
            assert rows(db_url, tenant) == 0 and effects(sandbox, tenant) == []

            # Fixed, the same key runs, once; a replay is the same answer, no new effect.
            first = caller.post(tenant, key)
            again = caller.post(tenant, key)
            assert first.status_code == 201 and again.status_code == 201
            assert again["Idempotent-Replayed"] == "true"
            assert json.loads(first.content) == json.loads(again.content)
            assert rows(db_url, tenant) == 1 and len(effects(sandbox, tenant)) == 1

            # The answer was lost; the retry now meets a refusal (the order is paid, the
            # session expired): it must not say nothing is stored, and changes nothing.
            stored = row(db_url, tenant)
            late = caller.post(tenant, key, refuse=raised)
            assert late.status_code == status
            says_what_is_true(json.loads(late.content)["detail"])
            assert row(db_url, tenant) == stored
            replay = caller.post(tenant, key)  # the same key, fixed: the first outcome
            assert replay.status_code == 201 and replay["Idempotent-Replayed"] == "true"
            assert json.loads(replay.content) == json.loads(first.content)
            assert len(effects(sandbox, tenant)) == 1
        finally:
            caller.close(sandbox_provider)


@pytest.fixture(params=["sqlite", "postgres"])
def empty_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'unmigrated.db'}"
    from test_schema_check import fresh_pg_database

    url: str = request.getfixturevalue("pg_server_url")
    return fresh_pg_database(request, url)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_unmigrated_database_answers_503_with_the_command_until_it_is_upgraded(
    django_ready: None,
    empty_db: str,
    sandbox: SandboxServer,
    sandbox_provider: SandboxProvider,
    loop_thread: LoopThread,
    caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    from django.test import override_settings

    tenant, key = f"t-{uuid.uuid4().hex[:10]}", f"k-{uuid.uuid4().hex}"
    caller = Caller(mode, loop_thread)
    settings = {
        "PROVIDERS": [sandbox_provider],
        "TENANT": "header:X-Tenant-Id",
        "OPERATION_URL": None,
    }
    with override_settings(PAYORCH={**settings, "DATABASE_URL": empty_db}):
        try:
            with caplog.at_level(logging.INFO, logger="payorch"):
                refused = caller.post(tenant, key)
            assert refused.status_code == 503 and refused["Content-Type"] == PROBLEM
            body = json.loads(refused.content)
            assert body["type"] == "urn:payorch:problem:schema-not-ready"
            assert "`payorch db upgrade`, or roll the code forward" in body["detail"]
            assert body["retry"] == "same_key" and int(refused["Retry-After"]) >= 1
            # The operator's line: what was found and what to run, at ERROR.
            logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            assert any("no payorch tables" in m and "payorch db upgrade" in m for m in logged)
            assert effects(sandbox, tenant) == []

            migrate.upgrade(empty_db)  # what the message said to run
            served = caller.post(tenant, key)
            assert served.status_code == 201, served.content
            assert len(effects(sandbox, tenant)) == 1
        finally:
            caller.close(sandbox_provider)


WAIT = 30.0  # seconds: a bound on each hand-over between the threads, never a pause


def test_while_the_check_fails_one_request_checks_and_the_others_answer_at_once(
    django_ready: None,
    tmp_path: Path,
    sandbox: SandboxServer,
    sandbox_provider: SandboxProvider,
    loop_thread: LoopThread,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A database away or not migrated: the store is kept across failed checks, one request
    at a time checks, and a request arriving meanwhile answers the last refusal without
    waiting for that check's I/O."""
    from django.test import override_settings

    from payorch.integrations.django import store
    from payorch.storage._store import Store

    url = f"sqlite:///{tmp_path / 'unmigrated.db'}"
    tenant, key = f"t-{uuid.uuid4().hex[:10]}", f"k-{uuid.uuid4().hex}"
    original = Store.check_schema
    checked: list[Store] = []
    hold, entered, release = threading.Event(), threading.Event(), threading.Event()

    def check(self: Store) -> str:
        checked.append(self)
        if hold.is_set():  # this check stays under way until the test releases it
            entered.set()
            assert release.wait(WAIT)
        return original(self)

    monkeypatch.setattr(Store, "check_schema", check)
    caller = Caller("sync", loop_thread)
    settings = {"PROVIDERS": [sandbox_provider], "OPERATION_URL": None, "DATABASE_URL": url}
    answers: dict[str, Any] = {}
    with override_settings(PAYORCH=settings):
        assert caller.post(tenant, key).status_code == 503  # no tables: refused, store kept
        hold.set()
        worker = threading.Thread(target=lambda: answers.update(a=caller.post(tenant, key)))
        worker.start()
        try:
            assert entered.wait(WAIT)
            meanwhile = caller.post(tenant, key)  # answered while the check is held
            assert meanwhile.status_code == 503 and int(meanwhile["Retry-After"]) >= 1
            body = json.loads(meanwhile.content)
            assert body["type"] == "urn:payorch:problem:schema-not-ready"
            assert len(checked) == 2  # the held one and the first: no check of its own
            migrate.upgrade(url)
        finally:
            release.set()
            worker.join(WAIT)
        assert not worker.is_alive() and answers["a"].status_code == 201
        assert len(checked) == 2 and checked[0] is checked[1] is store()  # one store
        assert caller.post(tenant, key)["Idempotent-Replayed"] == "true"
        assert len(checked) == 2 and len(effects(sandbox, tenant)) == 1
