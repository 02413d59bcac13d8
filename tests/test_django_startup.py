"""Django: a database without payorch's schema fails loudly before the first payment.

``urls()``'s ``readyz`` answers 503 ``schema-not-ready`` (the command to run logged) until
``payorch db upgrade`` ran, then 200, never cached; an unreachable database is 503 too.
``PayorchAppConfig`` registers a database-tagged system check: ``manage.py check --database
default`` reports ``payorch.E001`` until the upgrade. Sync and async, SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from conftest import LoopThread

from payorch import migrate
from payorch.providers.sandbox import SandboxProvider

PROBLEM = "application/problem+json"
APP = "payorch.integrations.django.PayorchAppConfig"


@pytest.fixture(scope="module")
def django_ready() -> None:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(ALLOWED_HOSTS=["testserver"], USE_TZ=True)
        django.setup()


@pytest.fixture(params=["sqlite", "postgres"])
def empty_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'unmigrated.db'}"
    from test_schema_check import fresh_pg_database

    url: str = request.getfixturevalue("pg_server_url")
    return fresh_pg_database(request, url)


def probe(mode: str, loop: LoopThread) -> Any:
    """``GET readyz`` the way its server would call it: sync here, async on the loop."""
    from django.test import AsyncRequestFactory, RequestFactory
    from django.urls import URLPattern

    from payorch.integrations.django import urls

    patterns = {str(p.pattern): p for p in urls(asynchronous=mode == "async")}
    view = patterns["readyz"]
    assert isinstance(view, URLPattern)
    if mode == "async":
        return loop.run(view.callback(AsyncRequestFactory().get("/payorch/readyz")))
    return view.callback(RequestFactory().get("/payorch/readyz"))


def close_async(mode: str, loop: LoopThread) -> None:
    if mode != "async":
        return
    from payorch.integrations.django import async_store

    async def close() -> None:  # the async store's pool belongs to the loop
        await async_store().close()

    loop.run(close())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_readyz_is_503_with_the_command_until_the_schema_is_upgraded(
    django_ready: None,
    empty_db: str,
    sandbox_provider: SandboxProvider,
    loop_thread: LoopThread,
    caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    from django.test import override_settings

    settings = {"PROVIDERS": [sandbox_provider], "OPERATION_URL": None, "DATABASE_URL": empty_db}
    with override_settings(PAYORCH=settings):
        try:
            with caplog.at_level(logging.INFO, logger="payorch"):
                refused = probe(mode, loop_thread)
            assert refused.status_code == 503 and refused["Content-Type"] == PROBLEM
            assert refused["Cache-Control"] == "no-store"
            body = json.loads(refused.content)
            assert body["type"] == "urn:payorch:problem:schema-not-ready"
            assert "`payorch db upgrade`, or roll the code forward" in body["detail"]
            assert int(refused["Retry-After"]) >= 1
            logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            assert any("no payorch tables" in m and "payorch db upgrade" in m for m in logged)

            migrate.upgrade(empty_db)  # what the log said to run
            ready = probe(mode, loop_thread)
            assert ready.status_code == 200 and json.loads(ready.content) == {"status": "ready"}
            assert ready["Cache-Control"] == "no-store"
        finally:
            close_async(mode, loop_thread)


def test_readyz_is_503_when_the_database_is_unreachable(
    django_ready: None, sandbox_provider: SandboxProvider, loop_thread: LoopThread
) -> None:
    from django.test import override_settings

    # Port 1 on loopback: nothing listens, the connection is refused at once.
    away = "postgresql+psycopg://payorch:secret@127.0.0.1:1/payorch"
    settings = {"PROVIDERS": [sandbox_provider], "OPERATION_URL": None, "DATABASE_URL": away}
    with override_settings(PAYORCH=settings):
        refused = probe("sync", loop_thread)
    assert refused.status_code == 503 and refused["Content-Type"] == PROBLEM
    assert refused["Cache-Control"] == "no-store"
    assert "secret" not in refused.content.decode()


def test_check_database_reports_e001_until_the_schema_is_upgraded(
    django_ready: None, empty_db: str, sandbox_provider: SandboxProvider
) -> None:
    from django.core.checks import run_checks
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError
    from django.test import override_settings

    settings = {"PROVIDERS": [sandbox_provider], "OPERATION_URL": None, "DATABASE_URL": empty_db}
    with override_settings(INSTALLED_APPS=[APP], PAYORCH=settings):
        # Without databases (runserver's checks, import): nothing connects, nothing reported.
        assert [m.id for m in run_checks(tags=["database"])] == []
        found = run_checks(databases=["default"], tags=["database"])
        assert [m.id for m in found] == ["payorch.E001"]
        assert "no payorch tables" in found[0].msg and "payorch db upgrade" in found[0].msg
        assert found[0].hint == "run: payorch db upgrade"
        with pytest.raises(SystemCheckError, match=r"payorch\.E001"):
            call_command("check", databases=["default"])

        migrate.upgrade(empty_db)
        assert run_checks(databases=["default"], tags=["database"]) == []
        call_command("check", databases=["default"])  # passes: no SystemCheckError
