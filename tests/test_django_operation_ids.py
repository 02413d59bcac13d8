"""Django's ``GET operations/<id>`` with an id no row can hold (issue 34): a NUL or a lone
surrogate is not found (404, problem+json), as in the FastAPI, Flask and ASGI integrations,
and never reaches the database (which refuses a NUL: a 503 "storage unavailable, retry"
logged at ERROR; a lone surrogate cannot be encoded: a 500). Sync and async views, on
SQLite and PostgreSQL; the statements sent are counted at the engines.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import LoopThread

from payorch.core import State
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider
from payorch.storage._store import Store

PROBLEM = "application/problem+json"
PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}
# Ids no row can hold: a NUL (PostgreSQL refuses it in text), a lone surrogate (no UTF-8).
UNHOLDABLE = ["op\x00id", "op\ud800id", "\x00"]


@pytest.fixture(scope="module")
def django_ready() -> None:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(ALLOWED_HOSTS=["testserver"], USE_TZ=True)
        django.setup()


@pytest.fixture
def statements() -> Iterator[list[str]]:
    """Every SQL statement any engine sends while the test runs."""
    sent: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        sent.append(statement)

    sa.event.listen(sa.Engine, "before_cursor_execute", count)
    yield sent
    sa.event.remove(sa.Engine, "before_cursor_execute", count)


class Caller:
    """GETs the operation view the way its server would: sync here, async on the loop."""

    def __init__(self, mode: str, loop: LoopThread, tenant: str) -> None:
        from django.test import AsyncRequestFactory, RequestFactory

        self.mode, self.loop, self.tenant = mode, loop, tenant
        self.factory = AsyncRequestFactory() if mode == "async" else RequestFactory()

    def get(self, operation_id: str) -> Any:
        from payorch.integrations.django import async_operation_view, operation_view

        # The resolver hands the view the path's decoded text as it is.
        request = self.factory.get("/payorch/operations/x", headers={"X-Tenant-Id": self.tenant})
        if self.mode == "async":
            return self.loop.run(async_operation_view(request, operation_id=operation_id))
        return operation_view(request, operation_id=operation_id)

    def close(self, provider: SandboxProvider) -> None:
        if self.mode != "async":
            return
        from payorch.integrations.django import async_store

        async def close() -> None:  # the async store's pool belongs to the loop
            await async_store().close()
            await provider.aclose()

        self.loop.run(close())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_id_no_row_can_hold_is_not_found_without_a_query(
    django_ready: None,
    db_url: str,
    store: Store,
    sandbox_provider: SandboxProvider,
    loop_thread: LoopThread,
    statements: list[str],
    caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    from django.test import override_settings

    tenant = f"t-{uuid.uuid4().hex[:10]}"
    executor = Executor(
        store=store,
        providers=[sandbox_provider],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
    )
    paid = executor.execute(
        tenant_id=tenant, operation="payment.create", idempotency_key="k-1", request=PAYMENT
    )
    assert paid.state is State.SUCCEEDED
    caller = Caller(mode, loop_thread, tenant)
    settings = {"PROVIDERS": [sandbox_provider], "TENANT": "header:X-Tenant-Id"}
    with override_settings(PAYORCH={**settings, "DATABASE_URL": db_url}):
        try:
            found = caller.get(paid.operation_id)  # the view and its store, working
            assert found.status_code == 200
            assert json.loads(found.content)["operation_id"] == paid.operation_id
            for unholdable in UNHOLDABLE:
                statements.clear()
                with caplog.at_level(logging.INFO, logger="payorch"):
                    answer = caller.get(unholdable)
                assert answer.status_code == 404, answer.content
                assert answer["Content-Type"] == PROBLEM
                body = json.loads(answer.content)
                assert body["type"] == "urn:payorch:problem:operation-not-found"
                assert body["status"] == 404 and "retry" not in body
                assert statements == []  # nothing reached the database
                assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
        finally:
            caller.close(sandbox_provider)
