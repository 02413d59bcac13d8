"""payorch.testing: the adapter kit (see docs/providers.md).

Subclass :class:`AdapterContract` in a test module, give the subclass an ``emulator``
fixture that returns an :class:`Emulator` of your provider, and pytest runs every check of
payorch's provider contract against the adapter that emulator builds.
"""

import pkgutil

import pytest

# pytest shows the compared values of a failing assert only in modules it rewrote, and it
# rewrites only test modules, conftests and modules registered before their import: the
# checks below, imported by the user's test module, are none of these until registered
# here. (This package itself is already importing, so its name would only draw a warning.)
pytest.register_assert_rewrite(*(f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__)))

from ._contract import AdapterContract  # noqa: E402 - registered for rewriting first
from ._emulator import Delivery, Emulator, Fault  # noqa: E402
from ._requests import status_query, submit_request, void_request  # noqa: E402
from ._webhook_checks import throwaway_stack  # noqa: E402

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
