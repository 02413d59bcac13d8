"""The shop's payment endpoints: one decorator each, sync and async."""

from typing import Any

from django.http import HttpRequest, JsonResponse

from payorch.integrations.django import idempotent
from payorch.providers.sandbox import SandboxProvider
from payorch.settings import Settings


def providers() -> list[SandboxProvider]:
    """PAYORCH["PROVIDERS"]: the loopback sandbox acquirer (`payorch sandbox serve`)."""
    env = Settings()  # PAYORCH_SANDBOX_URL, PAYORCH_SANDBOX_WEBHOOK_SECRET
    return [SandboxProvider(base_url=env.sandbox_url, webhook_secret=env.sandbox_webhook_secret)]


@idempotent("payment.create", status=201)
def create_payment(request: HttpRequest, payload: dict[str, Any]) -> dict[str, Any]:
    # Shape the request here (defaults, the customer from the session, ...); the tenant
    # comes from PAYORCH["TENANT"], never from this body.
    return {"capture_method": "automatic", **payload}


@idempotent("payment.create", status=201)
async def create_payment_async(request: HttpRequest, payload: dict[str, Any]) -> dict[str, Any]:
    return {"capture_method": "automatic", **payload}  # runs on the AsyncExecutor (ASGI)


def health(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True})
