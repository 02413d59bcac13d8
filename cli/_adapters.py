"""The application's own provider adapters, named by a ``module:attribute`` path.

``PAYORCH_PROVIDERS=shop.payments:providers`` lets the tools beside the app (the CLI, the
reconciler daemon) run the adapters the app runs, built by the app's code with the app's
configuration (a return URL, a merchant account, a custom adapter): a re-sent request, a
status query and a void then go out as the app's would. The attribute is a sequence of
adapters, a callable (no arguments) returning one, or the object that holds the app's
adapters (the FastAPI, Flask or ASGI integration's ``Payorch``/middleware, an ``Executor``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

from ..errors import ConfigurationError
from ..provider import Provider
from ..storage._outbox import resolve_path

__all__ = ["load_providers", "providers_from"]


def providers_from(value: Any, setting: str) -> list[Provider]:
    """The adapters ``value`` gives (a sequence, a callable returning one, or what holds the
    app's adapters: an integration's ``Payorch``, an ``Executor``); a ``ConfigurationError``
    in one line naming ``setting`` for anything else."""
    value = _held(value)
    if callable(value) and not isinstance(value, Provider):
        try:
            value = _held(value())  # a factory may return the integration it built
        except ConfigurationError as exc:
            raise ConfigurationError(f"{setting}: {exc.message}") from None
        except Exception as exc:  # noqa: BLE001 - the app's code: one line, not a trace
            raise ConfigurationError(
                f"{setting}: building the adapters failed: {type(exc).__name__}: {exc}"
            ) from None
    if isinstance(value, Provider):
        value = [value]
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ConfigurationError(
            f"{setting} must give provider adapters (a sequence, or a callable returning one)"
        )
    adapters = list(value)
    wrong = [type(a).__name__ for a in adapters if not isinstance(a, Provider)]
    if not adapters or wrong:
        what = f"{', '.join(wrong)} is not" if wrong else "nothing is"
        raise ConfigurationError(
            f"{setting}: {what} a provider adapter (name, idempotency_window, "
            "max_call_duration, submit, query_status, parse_webhook)"
        )
    names = [a.name for a in adapters]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigurationError(f"{setting}: two adapters named {twice[0]!r}")
    return adapters


def _held(value: Any) -> Any:
    """The adapters an object holds (an integration's ``Payorch``, an ``Executor``: their
    ``providers``), or ``value`` as it is."""
    held = getattr(value, "providers", None)
    if held is None or isinstance(value, Provider | ModuleType):
        return value
    return list(held.values()) if isinstance(held, Mapping) else held


def load_providers(path: str, setting: str = "PAYORCH_PROVIDERS") -> list[Provider]:
    """The adapters at ``module:attribute`` (:func:`providers_from`)."""
    return providers_from(resolve_path(path, setting), setting)
