"""The Stripe emulator's fixture, ``stripe_emulator`` (a plugin of tests/conftest.py); the
emulator itself ships as :mod:`payorch.providers.stripe.emulator`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from payorch.providers.stripe.emulator import StripeEmulator

__all__ = ["StripeEmulator", "stripe_emulator"]


@pytest.fixture
def stripe_emulator() -> Iterator[StripeEmulator]:
    """A started :class:`StripeEmulator`, stopped (its adapters closed) after the test."""
    with StripeEmulator() as emulator:
        yield emulator
