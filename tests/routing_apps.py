"""An application's two acquirers, importable by path (PAYORCH_PROVIDERS), as the CLI loads
them: what examples/routing.toml routes between."""

from __future__ import annotations

from payorch.providers.sandbox import SandboxProvider


def providers() -> list[SandboxProvider]:
    return [
        SandboxProvider(base_url="http://127.0.0.1:8765", name="acquirer_a"),
        SandboxProvider(base_url="http://127.0.0.1:8766", name="acquirer_b"),
    ]
