"""payorch.testing: the adapter kit (see docs/providers.md)."""

from ._emulator import Delivery, Emulator, Fault

__all__ = ["Delivery", "Emulator", "Fault"]
