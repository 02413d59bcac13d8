"""The kit's checks of voids: an authorisation released once, a capture never voided."""

from __future__ import annotations

import pytest

from ..provider import AnswerKind, Capability, Provider, Voider, can_void, capabilities_of
from ._emulator import Emulator
from ._requests import void_request
from ._support import KitBase, explain

__all__ = ["VoidContract"]

_TAKEN = (AnswerKind.SUCCEEDED, AnswerKind.PENDING)


def _voider(adapter: Provider, reference: str | None) -> Voider:
    if not isinstance(adapter, Voider) or not can_void(adapter, reference):
        declared = ", ".join(sorted(c.value for c in capabilities_of(adapter))) or "none"
        pytest.skip(
            f"the adapter cannot void this (capabilities: {declared}; void: "
            f"{'yes' if isinstance(adapter, Voider) else 'no'})"
        )
    return adapter


class VoidContract(KitBase):
    """Where ``can_void`` says so: a manual-capture authorisation voided, idempotently."""

    def test_a_void_releases_an_authorisation(self, emulator: Emulator, adapter: Provider) -> None:
        request = self.payment(emulator, capture_method="manual")
        made = adapter.submit(request)
        assert made.kind in _TAKEN, f"a manual-capture authorisation: {explain(made)}"
        voider = _voider(adapter, made.provider_reference)
        voiding = void_request(request, made.provider_reference)
        answer = voider.void(voiding)
        assert answer.kind in _TAKEN, explain(answer)
        assert emulator.voided(request.downstream_key)
        # Sent again (after a crash, say): the same void, no error.
        again = voider.void(voiding)
        assert again.kind in _TAKEN, f"a void re-sent is the same void: {explain(again)}"
        assert emulator.voided(request.downstream_key)
        assert emulator.effects(request.downstream_key) == 1

    def test_a_captured_payment_is_not_voided(self, emulator: Emulator, adapter: Provider) -> None:
        request = self.payment(emulator, capture_method="automatic")
        reference = self.assert_succeeded(adapter.submit(request))
        voider = _voider(adapter, reference)
        answer = voider.void(void_request(request, reference))
        # DECLINED, saying why; or PENDING where the provider judges voids later (Adyen's
        # cancellations arrive by notification). Never SUCCEEDED, and nothing voided.
        assert answer.kind in (AnswerKind.DECLINED, AnswerKind.PENDING), explain(answer)
        if answer.kind is AnswerKind.DECLINED:
            assert answer.code, f"a refused void says why: {explain(answer)}"
        assert not emulator.voided(request.downstream_key)
        assert emulator.effects(request.downstream_key) == 1

    def test_a_void_by_key_of_nothing_is_not_found_or_blocks_the_key(
        self, emulator: Emulator, adapter: Provider
    ) -> None:
        if Capability.VOID_BY_KEY not in capabilities_of(adapter):
            pytest.skip("the adapter does not void by key")
        request = self.payment(emulator)
        answer = _voider(adapter, None).void(void_request(request))
        # NOT_FOUND (nothing held, the key untouched); PENDING where the provider takes a
        # void by key and answers later; SUCCEEDED only if the key can no longer charge.
        allowed = (AnswerKind.NOT_FOUND, AnswerKind.PENDING, AnswerKind.SUCCEEDED)
        assert answer.kind in allowed, explain(answer)
        assert emulator.effects(request.downstream_key) == 0
        if answer.kind is AnswerKind.SUCCEEDED:
            late = adapter.submit(request)
            assert late.kind is not AnswerKind.SUCCEEDED, (
                f"a void that answered succeeded must block the key: {explain(late)}"
            )
            assert emulator.effects(request.downstream_key) == 0
