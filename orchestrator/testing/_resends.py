"""The kit's checks of a re-send: the request an adapter keeps, sent again as it is."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ..provider import Capability, Provider, Resender, WireRequest, capabilities_of
from ._emulator import Emulator
from ._support import KitBase, explain

__all__ = ["ResendContract"]


class ResendContract(KitBase):
    """A ``Resender`` says what it would send without sending it, the same every time, and
    sends that request as it is: the provider answers a re-send with the first outcome."""

    def test_a_replaying_adapter_can_keep_what_it_sends(self, adapter: Provider) -> None:
        if Capability.REPLAY in capabilities_of(adapter):
            assert isinstance(adapter, Resender), (
                "the adapter declares replay but has no wire_request: payorch re-sends only "
                "the request as first sent, so it would never replay (payorch.provider.Resender)"
            )

    def test_the_kept_request_is_the_one_sent_and_sent_again(
        self, emulator: Emulator, adapter: Provider
    ) -> None:
        if not isinstance(adapter, Resender):
            pytest.skip("the adapter keeps no request (no wire_request): it is never re-sent")
        request = self.payment(emulator)
        wire = adapter.wire_request(request)
        assert isinstance(wire, WireRequest), f"a valid payment is kept, not {wire!r}"
        assert emulator.effects(request.downstream_key) == 0, "wire_request sends nothing"
        assert adapter.wire_request(request) == wire, "the same request, built twice, is equal"
        assert wire.idempotency_key in (None, request.downstream_key)
        # The request built now and the kept one are one request under the key: the provider
        # answers the kept one with the first effect (another request would be refused).
        first = adapter.submit(request)
        reference = self.assert_succeeded(first)
        again = adapter.submit(replace(request, wire=wire))
        assert again.kind is first.kind, explain(again)
        assert again.provider_reference == reference, explain(again)
        assert emulator.effects(request.downstream_key) == 1
