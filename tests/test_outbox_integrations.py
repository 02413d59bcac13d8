"""The web integrations give their stores the outbox's hooks: FastAPI's ``Payorch`` and
Django's ``settings.PAYORCH["OUTBOX_HOOKS"]`` (or ``PAYORCH_OUTBOX_HOOKS``), so a payment
settled through them stages its messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import outbox_apps
import pytest

from payorch import migrate
from payorch.errors import ConfigurationError
from payorch.providers.sandbox import SandboxProvider


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite+aiosqlite:///{tmp_path / 'shop.db'}"
    migrate.upgrade(f"sqlite:///{tmp_path / 'shop.db'}")
    return url


def test_fastapi_payorch_gives_its_store_the_hooks(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from payorch.integrations.fastapi import Payorch
    from payorch.storage._async_store import AsyncStore

    adapter = SandboxProvider(base_url="http://127.0.0.1:9")
    given = Payorch(providers=[adapter], url=url, outbox_hooks=outbox_apps.hooks)
    assert given.store.sync.outbox_hooks is outbox_apps.hooks
    monkeypatch.setenv("PAYORCH_OUTBOX_HOOKS", "outbox_apps:hooks")
    from_env = Payorch(providers=[adapter], url=url)
    assert from_env.store.sync.outbox_hooks is outbox_apps.hooks
    with pytest.raises(ConfigurationError, match="give the store its outbox_hooks"):
        Payorch(providers=[adapter], store=AsyncStore.from_url(url), outbox_hooks=outbox_apps.hooks)


def test_django_settings_name_the_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    import django
    from django.conf import settings
    from django.test import override_settings

    if not settings.configured:
        settings.configure(ALLOWED_HOSTS=["testserver"], USE_TZ=True)
        django.setup()
    from payorch.integrations.django import PayorchConfig

    base: dict[str, Any] = {"PROVIDERS": "outbox_integrations_providers"}
    for spec in ("outbox_apps:hooks", "outbox_apps.hooks", outbox_apps.hooks):
        with override_settings(PAYORCH={**base, "OUTBOX_HOOKS": spec}):
            assert PayorchConfig.from_settings().outbox_hooks is outbox_apps.hooks
    with override_settings(PAYORCH=base):
        assert PayorchConfig.from_settings().outbox_hooks is None
        monkeypatch.setenv("PAYORCH_OUTBOX_HOOKS", "outbox_apps:hooks")
        assert PayorchConfig.from_settings().outbox_hooks is outbox_apps.hooks
    with (
        override_settings(PAYORCH={**base, "OUTBOX_HOOKS": "outbox_apps.recorder"}),
        pytest.raises(ConfigurationError, match="must give a payorch OutboxHooks"),
    ):
        PayorchConfig.from_settings()
