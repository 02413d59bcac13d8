"""The README's and the docs' service snippets start with each shipped adapter swapped in, as
"swap SandboxProvider for StripeProvider in production" promises: the lease fits the
adapter's worst case (one execute() with every inline retry), whatever its time-outs.

Read from the files now, never copied here; the adapter's construction is the only change."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from payorch.execution._executor import Executor

ROOT = Path(__file__).resolve().parents[1]
SANDBOX = "SandboxProvider(base_url=env.sandbox_url, webhook_secret=env.sandbox_webhook_secret)"
STRIPE_README = "StripeProvider(api_key=STRIPE_KEY, webhook_secret=STRIPE_WHSEC)"
# Each shipped adapter as a production service builds it (default time-outs).
ADAPTERS = {
    "sandbox": (
        "from payorch.providers.sandbox import SandboxProvider",
        'SandboxProvider(base_url="http://127.0.0.1:9", webhook_secret="whsec_'
        + "c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0"
        + '")',
    ),
    "stripe": (
        "from payorch.providers.stripe import StripeProvider",
        'StripeProvider(api_key="sk_test_x", webhook_secret="whsec_x")',
    ),
    "adyen": (
        "from payorch.providers.adyen import AdyenProvider",
        'AdyenProvider(api_key="AQE_x", merchant_account="ShopECOM", hmac_key="44782DEF",'
        ' base_url="https://checkout-test.adyen.com/v71", return_url="https://shop.example/r")',
    ),
}


def blocks(doc: str, needle: str) -> list[str]:
    text = (ROOT / doc).read_text()
    found = re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)
    return [b for b in found if needle in b]


SNIPPETS = [
    ("README.md", "payorch.integrations.fastapi"),
    ("docs/embedding.md", "payorch.integrations.fastapi"),
    ("docs/integrations.md", "payorch.integrations.flask"),
    ("docs/integrations.md", "PayorchMiddleware"),
]


def swapped(code: str, adapter: str) -> str:
    importing, built = ADAPTERS[adapter]
    assert SANDBOX in code, "the snippet builds the sandbox as the test expects"
    return f"{importing}\n{code.replace(SANDBOX, built)}"


def executors_of(namespace: dict[str, Any]) -> list[Executor]:
    """The executors the snippet's integration built (sync, or the async one's twin)."""
    found = []
    for value in namespace.values():
        for holder in (value, getattr(value, "executor", None)):
            inner = getattr(holder, "_sync", holder)
            if isinstance(inner, Executor):
                found.append(inner)
    return found


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
@pytest.mark.parametrize(("doc", "needle"), SNIPPETS)
def test_each_service_snippet_starts_with_each_adapter(
    doc: str, needle: str, adapter: str, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAYORCH_DATABASE_URL", db_url)
    (code,) = blocks(doc, needle)
    namespace: dict[str, Any] = {"__name__": "snippet"}
    exec(compile(swapped(code, adapter), doc, "exec"), namespace)  # the doc's text, as run
    built = executors_of(namespace) or executors_of(vars(namespace.get("payorch", object())))
    assert built, "the snippet built its executor at start-up"
    for executor in built:
        for provider in executor.providers.values():
            assert executor.lease >= executor.lease_needed(provider)
    closing = getattr(namespace.get("payorch"), "close", None)
    if callable(closing) and needle != "payorch.integrations.fastapi":
        closing()


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_the_readme_embedding_snippet_starts_with_each_adapter(adapter: str, db_url: str) -> None:
    (code,) = blocks("README.md", "payments = Executor(")
    setup = code.split("try:")[0]  # what runs at start-up: the executor, built
    importing, built = ADAPTERS[adapter]
    setup = setup.replace(STRIPE_README, built).replace(
        'provider="stripe"', f'provider="{adapter}"'
    )
    setup = re.sub(r'url = "[^"]+"', f"url = {db_url!r}", setup)
    namespace: dict[str, Any] = {"__name__": "snippet"}
    exec(compile(f"{importing}\n{setup}", "README.md", "exec"), namespace)
    payments = namespace["payments"]
    (provider,) = payments.providers.values()
    assert provider.name == adapter
    assert payments.lease >= payments.lease_needed(provider)
    payments.store.close()
