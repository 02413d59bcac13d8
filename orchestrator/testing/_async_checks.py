"""The kit's checks of the async API, for adapters that are also an ``AsyncProvider``."""

from __future__ import annotations

import pytest

from ..provider import (
    Answer,
    AnswerKind,
    AsyncProvider,
    AsyncVoider,
    Capability,
    Provider,
    can_void,
    capabilities_of,
)
from ._emulator import Emulator, Fault
from ._requests import status_query, void_request
from ._support import COMMITTED_FAULTS, KitBase, explain, require_fault, run_async

__all__ = ["AsyncContract"]


def _async(adapter: Provider) -> AsyncProvider:
    if not isinstance(adapter, AsyncProvider):
        pytest.skip("the adapter is not an AsyncProvider (no asubmit / aquery_status)")
    return adapter


class AsyncContract(KitBase):
    """The async mirrors: the same answers through ``asubmit``, ``aquery_status``, ``avoid``."""

    def test_async_the_same_key_gets_the_same_answer(
        self, emulator: Emulator, adapter: Provider
    ) -> None:
        provider = _async(adapter)
        request = self.payment(emulator)

        async def body() -> tuple[Answer, Answer, Answer | None]:
            first = await provider.asubmit(request)
            again = await provider.asubmit(request)
            asked = None
            if Capability.STATUS_BY_REFERENCE in capabilities_of(adapter) and (
                first.provider_reference
            ):
                asked = await provider.aquery_status(
                    status_query(request, first.provider_reference)
                )
            return first, again, asked

        first, again, asked = run_async(adapter, body)
        reference = self.assert_succeeded(first)
        assert (again.kind, again.provider_reference) == (first.kind, reference), explain(again)
        if asked is not None:
            assert asked.kind is AnswerKind.SUCCEEDED, explain(asked)
            assert asked.provider_reference == reference, explain(asked)
        assert emulator.effects(request.downstream_key) == 1

    @pytest.mark.parametrize(
        "fault", [Fault.ERROR_AFTER_COMMIT, Fault.ERROR_BEFORE_COMMIT], ids=lambda f: f.value
    )
    def test_async_a_possibly_sent_fault_is_ambiguous(
        self, emulator: Emulator, adapter: Provider, fault: Fault
    ) -> None:
        provider = _async(adapter)
        require_fault(emulator, fault, adapter)
        request = self.payment(emulator)
        key = request.downstream_key
        counted: list[int] = []

        async def body() -> tuple[Answer, Answer]:
            emulator.inject(fault)
            answer = await provider.asubmit(request)
            counted.append(emulator.effects(key))
            return answer, await provider.asubmit(request)

        answer, again = run_async(adapter, body)
        assert answer.kind is AnswerKind.AMBIGUOUS, f"{fault.value}: {explain(answer)}"
        assert counted == [1 if fault in COMMITTED_FAULTS else 0]
        self.assert_succeeded(again)
        assert emulator.effects(key) == 1

    def test_async_a_void_releases_an_authorisation(
        self, emulator: Emulator, adapter: Provider
    ) -> None:
        provider = _async(adapter)
        request = self.payment(emulator, capture_method="manual")

        async def body() -> tuple[Answer, list[Answer]]:
            authorised = await provider.asubmit(request)
            reference = authorised.provider_reference
            if not isinstance(adapter, AsyncVoider) or not can_void(adapter, reference):
                return authorised, []
            voiding = void_request(request, reference)
            return authorised, [await adapter.avoid(voiding), await adapter.avoid(voiding)]

        authorised, voids = run_async(adapter, body)
        assert authorised.kind in (AnswerKind.SUCCEEDED, AnswerKind.PENDING), explain(authorised)
        if not voids:
            pytest.skip("the adapter cannot void this through the async API (avoid)")
        for each in voids:
            assert each.kind in (AnswerKind.SUCCEEDED, AnswerKind.PENDING), explain(each)
        assert emulator.voided(request.downstream_key)
