"""The adapter kit (payorch.testing) run against payorch's own adapters, each through an
emulator of its provider: the sandbox acquirer, Stripe and Adyen."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from payorch.providers.adyen.emulator import AdyenEmulator
from payorch.providers.sandbox.emulator import SandboxEmulator, running
from payorch.providers.stripe.emulator import StripeEmulator
from payorch.testing import AdapterContract


class TestSandboxAdapter(AdapterContract):
    @pytest.fixture
    def emulator(self) -> Iterator[SandboxEmulator]:
        with running() as emulator:
            yield emulator


class TestStripeAdapter(AdapterContract):
    @pytest.fixture
    def emulator(self) -> Iterator[StripeEmulator]:
        with StripeEmulator() as emulator:
            yield emulator


class TestAdyenAdapter(AdapterContract):
    @pytest.fixture
    def emulator(self) -> Iterator[AdyenEmulator]:
        with AdyenEmulator() as emulator:
            yield emulator
