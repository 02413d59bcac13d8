"""A webhook route for an adapter built without its webhook secret is refused at start-up, in
one line naming the provider and the secret, by every integration that serves one: FastAPI's
router, Flask's blueprint, the ASGI middleware, Django's URLconf (system check
``payorch.E003``). Served, such a route would answer every delivery 500 "retry with the same
idempotency key", and the provider would re-send it for days. An app that takes no webhooks
leaves the route out (``webhooks=None``) and starts.

An adapter says whether it can verify a delivery with ``verifies_webhooks``.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from payorch.errors import ConfigurationError
from payorch.providers.adyen import AdyenProvider
from payorch.providers.sandbox import SandboxProvider
from payorch.providers.stripe import StripeProvider

APP = "payorch.integrations.django.PayorchAppConfig"
LOOPBACK = "http://127.0.0.1:9"


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'payorch.db'}"  # nothing connects before start-up


@pytest.fixture
def unsigned() -> Iterator[SandboxProvider]:
    with SandboxProvider(base_url=LOOPBACK) as adapter:  # no webhook_secret
        yield adapter


def test_fastapi_refuses_a_webhook_router_for_an_adapter_without_its_secret(
    url: str, unsigned: SandboxProvider
) -> None:
    from fastapi import FastAPI
    from starlette.routing import NoMatchFound

    from payorch.integrations.fastapi import OPERATION_ROUTE, WEBHOOK_ROUTE, Payorch

    payorch = Payorch(url=url, providers=[unsigned])
    with pytest.raises(ConfigurationError) as refused:
        payorch.router()
    message = str(refused.value)
    assert "\n" not in message
    assert "provider 'sandbox'" in message and "no webhook secret" in message
    assert "SandboxProvider(webhook_secret=...)" in message
    assert "router(webhooks=None)" in message
    with pytest.raises(ConfigurationError, match="provider 'sandbox'"):
        payorch.webhook_router()
    # Without the webhook route it starts: the operation resource alone.
    app = FastAPI()
    app.include_router(payorch.router(webhooks=None))
    assert app.url_path_for(OPERATION_ROUTE, operation_id="op-1") == "/operations/op-1"
    with pytest.raises(NoMatchFound):
        app.url_path_for(WEBHOOK_ROUTE, tenant="shop", provider="sandbox")


@pytest.mark.parametrize(
    ("adapter", "secret"),
    [
        (lambda: StripeProvider(api_key="sk_test_x", base_url=LOOPBACK), "webhook_secret"),
        (
            lambda: AdyenProvider(api_key="k", merchant_account="Shop", base_url=LOOPBACK),
            "hmac_key",
        ),
    ],
    ids=["stripe", "adyen"],
)
def test_the_refusal_names_each_providers_own_secret(url: str, adapter: Any, secret: str) -> None:
    from payorch.integrations.flask import Payorch

    with adapter() as built:
        payorch = Payorch(url=url, providers=[built], lease=timedelta(minutes=5))
        with pytest.raises(ConfigurationError) as refused:
            payorch.blueprint()
    message = str(refused.value)
    assert f"provider {built.name!r}" in message
    assert f"{type(built).__name__}({secret}=...)" in message
    assert "blueprint(webhooks=None)" in message


def test_flask_refuses_the_blueprints_webhook_route_and_serves_without_it(
    url: str, unsigned: SandboxProvider
) -> None:
    from flask import Flask

    from payorch.integrations.flask import Payorch

    payorch = Payorch(url=url, providers=[unsigned])
    with pytest.raises(ConfigurationError, match=r"provider 'sandbox'.*blueprint\(webhooks=None\)"):
        payorch.blueprint()
    app = Flask(__name__)
    app.register_blueprint(payorch.blueprint(webhooks=None))
    rules = {rule.rule for rule in app.url_map.iter_rules() if rule.endpoint.startswith("payorch")}
    assert rules == {"/operations/<operation_id>"}
    # No webhook route: a delivery meets the app's 404, not payorch's 500.
    assert app.test_client().post("/webhooks/shop/sandbox", data=b"{}").status_code == 404
    payorch.close()


def test_the_asgi_middleware_refuses_and_hands_webhooks_to_the_app_without_the_route(
    url: str, unsigned: SandboxProvider
) -> None:
    import asyncio

    from payorch.integrations.asgi import PayorchMiddleware, Receive, Scope, Send

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"the app's"})

    with pytest.raises(ConfigurationError, match=r"webhooks=None"):
        PayorchMiddleware(inner, url=url, providers=[unsigned], routes={})
    app = PayorchMiddleware(inner, url=url, providers=[unsigned], routes={}, webhooks=None)

    async def deliver() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.post("/webhooks/shop/sandbox", content=b"{}")

    answered = asyncio.run(deliver())
    assert (answered.status_code, answered.content) == (404, b"the app's")


@pytest.fixture(scope="module")
def django_ready() -> None:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(ALLOWED_HOSTS=["testserver"], USE_TZ=True)
        django.setup()


def urlconf(*patterns: Any) -> types.ModuleType:
    module = types.ModuleType("shop_urls")
    module.urlpatterns = list(patterns)
    return module


def test_django_check_reports_e003_where_the_urlconf_serves_webhooks(
    django_ready: None, url: str, unsigned: SandboxProvider
) -> None:
    from django.core.checks import run_checks
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError
    from django.test import override_settings
    from django.urls import include, path

    from payorch.integrations.django import async_webhook_view, operation_view, urls

    settings = {"PROVIDERS": [unsigned], "OPERATION_URL": None, "DATABASE_URL": url}
    served = urlconf(path("payorch/", include(urls())))
    with override_settings(INSTALLED_APPS=[APP], PAYORCH=settings, ROOT_URLCONF=served):
        found = [m for m in run_checks(tags=["urls"]) if m.id.startswith("payorch")]
        assert [m.id for m in found] == ["payorch.E003"]
        assert "provider 'sandbox'" in found[0].msg and "webhook_secret=" in found[0].msg
        with pytest.raises(SystemCheckError, match=r"payorch\.E003"):
            call_command("check")
    # Mounted by hand, unnamed, it is found all the same.
    by_hand = urlconf(path("hooks/<str:tenant>/<str:provider>", async_webhook_view))
    with override_settings(INSTALLED_APPS=[APP], PAYORCH=settings, ROOT_URLCONF=by_hand):
        assert [m.id for m in run_checks(tags=["urls"])] == ["payorch.E003"]
    # A URLconf without payorch's webhook views: nothing to refuse.
    operations = urlconf(path("operations/<str:operation_id>", operation_view))
    with override_settings(INSTALLED_APPS=[APP], PAYORCH=settings, ROOT_URLCONF=operations):
        assert [m.id for m in run_checks(tags=["urls"])] == []
        call_command("check")


def test_payorchs_adapters_say_whether_they_verify_webhooks() -> None:
    secret = "whsec_c2FuZGJveC1yZWNpcGUtc2VjcmV0LTEyMzQ1Ng=="
    hmac_key = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056"
    adyen = {"api_key": "k", "merchant_account": "Shop", "base_url": LOOPBACK}
    built = [
        (SandboxProvider(base_url=LOOPBACK), False),
        (SandboxProvider(base_url=LOOPBACK, webhook_secret=secret), True),
        (StripeProvider(api_key="sk_test_x", base_url=LOOPBACK), False),
        (StripeProvider(api_key="sk_test_x", base_url=LOOPBACK, webhook_secret="whsec_x"), True),
        (AdyenProvider(**adyen), False),
        (AdyenProvider(**adyen, hmac_key=hmac_key), True),
    ]
    try:
        assert [a.verifies_webhooks for a, _ in built] == [want for _, want in built]
    finally:
        for adapter, _ in built:
            adapter.close()
