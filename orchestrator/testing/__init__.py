"""payorch.testing: the adapter kit (see docs/providers.md).

Subclass :class:`AdapterContract` in a test module, give the subclass an ``emulator``
fixture that returns an :class:`Emulator` of your provider, and pytest runs every check of
payorch's provider contract against the adapter that emulator builds.
"""

from ._contract import AdapterContract
from ._emulator import Delivery, Emulator, Fault
from ._requests import status_query, submit_request, void_request
from ._webhook_checks import throwaway_stack

__all__ = [
    "AdapterContract",
    "Delivery",
    "Emulator",
    "Fault",
    "status_query",
    "submit_request",
    "throwaway_stack",
    "void_request",
]
