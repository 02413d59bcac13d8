"""The adapter kit (payorch.testing) run against payorch's own adapters, each through an
emulator of its provider: the sandbox acquirer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sandbox_emulator import SandboxEmulator, running

from payorch.testing import AdapterContract


class TestSandboxAdapter(AdapterContract):
    @pytest.fixture
    def emulator(self) -> Iterator[SandboxEmulator]:
        with running() as emulator:
            yield emulator
