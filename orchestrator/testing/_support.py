"""What every part of the adapter kit shares: the adapter fixture, skips, answer checks."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

from ..provider import Answer, AnswerKind, Capability, Provider, SubmitRequest, capabilities_of
from ._emulator import Emulator, Fault
from ._requests import submit_request

__all__ = [
    "HOOKS",
    "NOT_SENT_FAULTS",
    "POSSIBLY_SENT_FAULTS",
    "KitBase",
    "close_adapter",
    "explain",
    "irrelevant",
    "require_capability",
    "require_fault",
    "run_async",
]

T = TypeVar("T")

# Refused before anything was done: the adapter must say NOT_SENT (retry, same key).
NOT_SENT_FAULTS = frozenset({Fault.RATE_LIMITED, Fault.IN_FLIGHT})
# The request may have reached the provider: AMBIGUOUS, never NOT_SENT.
POSSIBLY_SENT_FAULTS = frozenset(
    {Fault.ERROR_BEFORE_COMMIT, Fault.ERROR_AFTER_COMMIT, Fault.DROP_AFTER_COMMIT}
)
# Faults after which the effect exists at the provider.
COMMITTED_FAULTS = frozenset({Fault.ERROR_AFTER_COMMIT, Fault.DROP_AFTER_COMMIT})


def explain(answer: Answer) -> str:
    """An answer in one line, for assertion messages."""
    parts = [answer.kind.value]
    for name in ("provider_reference", "status_code", "code", "message"):
        value = getattr(answer, name)
        if value is not None:
            parts.append(f"{name}={value!r}")
    return " ".join(parts)


# What each fault hook must do, for a failure naming the one an emulator lacks.
HOOKS: dict[Fault, str] = {
    Fault.RATE_LIMITED: "answer the next submission 429, doing nothing",
    Fault.IN_FLIGHT: (
        "answer the next submission as the provider does while another request under its "
        "key is running (a 409), doing nothing"
    ),
    Fault.ERROR_BEFORE_COMMIT: "answer the next submission 5xx, doing nothing",
    Fault.ERROR_AFTER_COMMIT: "make the next submission's effect, then answer 5xx",
    Fault.DROP_AFTER_COMMIT: (
        "make the next submission's effect, then close the connection unanswered"
    ),
    Fault.DECLINE: "decline the next submission finally: no effect, the key declines again",
}


def irrelevant(adapter: Provider, fault: Fault) -> str | None:
    """Why ``fault`` says nothing about ``adapter`` (its declaration rules it out), or None."""
    if fault is Fault.IN_FLIGHT and adapter.idempotency_window is None:
        return "the adapter's provider honours no idempotency key (idempotency_window None)"
    return None


def require_fault(emulator: Emulator, fault: Fault, adapter: Provider) -> None:
    """Fail unless the emulator can inject ``fault``, naming the hook to implement; skip
    only where the adapter's declaration makes the fault irrelevant. A missing hook is a
    check not run: were it a skip, an adapter never proven against it would pass green."""
    if fault in emulator.faults:
        return
    reason = irrelevant(adapter, fault)
    if reason is not None:
        pytest.skip(f"{fault.value} does not apply: {reason}")
    pytest.fail(
        f"the emulator lacks the {fault.value} fault hook: list Fault.{fault.name} in its "
        f"`faults` and make `inject(Fault.{fault.name})` {HOOKS[fault]}",
        pytrace=False,
    )


def require_capability(adapter: object, *wanted: Capability) -> None:
    """Skip unless the adapter declares at least one of ``wanted``."""
    declared = capabilities_of(adapter)
    if not declared.intersection(wanted):
        names = " or ".join(c.value for c in wanted)
        have = ", ".join(sorted(c.value for c in declared)) or "none"
        pytest.skip(f"the adapter declares no {names} (its capabilities: {have})")


def close_adapter(adapter: object) -> None:
    """Close what the adapter opened, if it can be closed."""
    close = getattr(adapter, "close", None)
    if callable(close):
        close()


def run_async(adapter: object, body: Callable[[], Awaitable[T]]) -> T:
    """Run ``body`` on a fresh event loop, then close the adapter's async clients (``aclose``)
    on that same loop: an async client is bound to the loop that opened it."""

    async def main() -> T:
        try:
            return await body()
        finally:
            aclose = getattr(adapter, "aclose", None)
            if callable(aclose):
                closing = aclose()
                if inspect.isawaitable(closing):
                    await closing

    return asyncio.run(main())


class KitBase:
    """The fixtures the kit's checks share; the author supplies ``emulator``."""

    @pytest.fixture
    def adapter(self, emulator: Emulator) -> Iterator[Provider]:
        """The adapter under test, pointed at the emulator, closed afterwards."""
        made = emulator.adapter()
        try:
            yield made
        finally:
            close_adapter(made)

    @staticmethod
    def payment(emulator: Emulator, **overrides: Any) -> SubmitRequest:
        """A fresh ``payment.create`` request, as payorch's executor would send it."""
        return submit_request(emulator.payload("payment.create", **overrides))

    @staticmethod
    def assert_succeeded(answer: Answer) -> str:
        """The provider reference of a SUCCEEDED answer (failing otherwise)."""
        assert answer.kind is AnswerKind.SUCCEEDED, explain(answer)
        assert answer.provider_reference, f"a success names its effect: {explain(answer)}"
        return answer.provider_reference
