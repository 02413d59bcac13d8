"""The kit's checks of submissions, faults, the window and status queries."""

from __future__ import annotations

from datetime import timedelta

import pytest

from ..provider import (
    STATUS_CAPABILITIES,
    AnswerKind,
    Capability,
    Provider,
    can_query_status,
    capabilities_of,
)
from ._emulator import Emulator, Fault
from ._requests import status_query
from ._support import (
    COMMITTED_FAULTS,
    NOT_SENT_FAULTS,
    POSSIBLY_SENT_FAULTS,
    KitBase,
    close_adapter,
    explain,
    require_capability,
    require_fault,
)

__all__ = ["SubmitContract"]

IN_FLIGHT_KINDS = (AnswerKind.NOT_SENT, AnswerKind.AMBIGUOUS)


class SubmitContract(KitBase):
    """Same key, same answer; every fault classified; the window; status queries."""

    # -- the declaration ------------------------------------------------------------------

    def test_declares_a_name_a_window_and_a_call_bound(self, adapter: Provider) -> None:
        assert isinstance(adapter, Provider), "the adapter lacks part of payorch.provider.Provider"
        assert isinstance(adapter.name, str) and adapter.name, "an adapter has a name"
        window = adapter.idempotency_window
        assert window is None or (isinstance(window, timedelta) and window > timedelta(0)), (
            f"idempotency_window is None or a positive timedelta, not {window!r}"
        )
        assert adapter.max_call_duration > timedelta(0), "max_call_duration bounds every call"
        capabilities = capabilities_of(adapter)  # raises on a value that is no Capability
        if Capability.REPLAY in capabilities:
            assert window is not None, "a replay needs a window in which the key is honoured"

    # -- same key, same answer ------------------------------------------------------------

    def test_the_same_key_gets_the_same_answer(self, emulator: Emulator, adapter: Provider) -> None:
        request = self.payment(emulator)
        first = adapter.submit(request)
        reference = self.assert_succeeded(first)
        again = adapter.submit(request)
        assert again.kind is first.kind, explain(again)
        assert again.provider_reference == reference, explain(again)
        assert emulator.effects(request.downstream_key) == 1

    # -- every fault classified -----------------------------------------------------------

    @pytest.mark.parametrize("fault", list(Fault), ids=lambda f: f.value)
    def test_a_fault_is_classified(
        self, emulator: Emulator, adapter: Provider, fault: Fault
    ) -> None:
        require_fault(emulator, fault, adapter)
        request = self.payment(emulator)
        key = request.downstream_key
        emulator.inject(fault)
        answer = adapter.submit(request)
        if fault is Fault.IN_FLIGHT:
            # This request did nothing, but another under its key is running and may move
            # money: NOT_SENT (retry the key) or AMBIGUOUS (ask the provider); never final.
            assert answer.kind in IN_FLIGHT_KINDS, f"{fault.value}: {explain(answer)}"
            assert emulator.effects(key) == 0
        elif fault in NOT_SENT_FAULTS:
            assert answer.kind is AnswerKind.NOT_SENT, f"{fault.value}: {explain(answer)}"
            assert emulator.effects(key) == 0
            if fault is Fault.RATE_LIMITED:
                # Nothing was done: the same key runs again and makes the one effect.
                self.assert_succeeded(adapter.submit(request))
                assert emulator.effects(key) == 1
        elif fault in POSSIBLY_SENT_FAULTS:
            assert answer.kind is AnswerKind.AMBIGUOUS, f"{fault.value}: {explain(answer)}"
            assert emulator.effects(key) == (1 if fault in COMMITTED_FAULTS else 0)
            # The same request under the same key: the effect's outcome, one effect.
            self.assert_succeeded(adapter.submit(request))
            assert emulator.effects(key) == 1
        else:
            assert fault is Fault.DECLINE
            assert answer.kind is AnswerKind.DECLINED, explain(answer)
            assert answer.code, f"a decline says why: {explain(answer)}"
            assert emulator.effects(key) == 0
            again = adapter.submit(request)
            assert again.kind is AnswerKind.DECLINED, f"declined again: {explain(again)}"
            assert emulator.effects(key) == 0

    def test_an_unreachable_provider_was_not_sent(self, emulator: Emulator) -> None:
        unreachable = emulator.unreachable_adapter()
        try:
            request = self.payment(emulator)
            answer = unreachable.submit(request)
            assert answer.kind is AnswerKind.NOT_SENT, f"a connect error: {explain(answer)}"
            if can_query_status(unreachable):
                asked = unreachable.query_status(status_query(request))
                assert asked.kind is AnswerKind.NOT_SENT, explain(asked)
        finally:
            close_adapter(unreachable)
        assert emulator.effects(request.downstream_key) == 0

    # -- status queries -------------------------------------------------------------------

    def test_a_status_query_answers_the_effects_outcome(
        self, emulator: Emulator, adapter: Provider
    ) -> None:
        require_capability(adapter, *STATUS_CAPABILITIES)
        request = self.payment(emulator)
        reference = self.assert_succeeded(adapter.submit(request))
        capabilities = capabilities_of(adapter)
        if Capability.STATUS_BY_REFERENCE in capabilities:
            by_reference = adapter.query_status(status_query(request, reference))
            assert by_reference.kind is AnswerKind.SUCCEEDED, explain(by_reference)
            assert by_reference.provider_reference == reference, explain(by_reference)
        if Capability.STATUS_BY_KEY in capabilities:
            by_key = adapter.query_status(status_query(request))
            assert by_key.kind is AnswerKind.SUCCEEDED, explain(by_key)
            assert by_key.provider_reference == reference, explain(by_key)
        assert emulator.effects(request.downstream_key) == 1

    def test_a_key_never_sent_is_not_found(self, emulator: Emulator, adapter: Provider) -> None:
        require_capability(adapter, Capability.STATUS_BY_KEY)
        request = self.payment(emulator)
        answer = adapter.query_status(status_query(request))
        assert answer.kind is AnswerKind.NOT_FOUND, explain(answer)
        assert emulator.effects(request.downstream_key) == 0

    def test_without_a_status_capability_a_query_claims_nothing(
        self, emulator: Emulator, adapter: Provider
    ) -> None:
        if can_query_status(adapter):
            pytest.skip("the adapter declares a status capability")
        request = self.payment(emulator)
        reference = self.assert_succeeded(adapter.submit(request))
        for query in (status_query(request, reference), status_query(self.payment(emulator))):
            answer = adapter.query_status(query)
            assert answer.kind is AnswerKind.AMBIGUOUS, explain(answer)
            assert answer.code == "status_unsupported", explain(answer)
            assert emulator.effects(query.downstream_key) == (
                1 if query.downstream_key == request.downstream_key else 0
            )
