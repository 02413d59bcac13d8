"""The Adyen emulator's fixtures, ``adyen_emulator`` and ``adyen_provider`` (a plugin of
tests/conftest.py); the emulator itself ships as :mod:`payorch.providers.adyen.emulator`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from payorch.providers.adyen import AdyenProvider
from payorch.providers.adyen.emulator import AdyenEmulator

__all__ = ["AdyenEmulator", "adyen_emulator", "adyen_provider"]


@pytest.fixture
def adyen_emulator() -> Iterator[AdyenEmulator]:
    """A started :class:`AdyenEmulator`, stopped after the test."""
    with AdyenEmulator() as emulator:
        yield emulator


@pytest.fixture
def adyen_provider(adyen_emulator: AdyenEmulator) -> Iterator[AdyenProvider]:
    """An :class:`AdyenProvider` pointed at ``adyen_emulator``."""
    with adyen_emulator.adapter() as provider:
        yield provider
