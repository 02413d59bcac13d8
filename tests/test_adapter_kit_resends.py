"""The kit's re-send checks fail an adapter that cannot keep what it sends yet declares
replay, and one whose kept request is not the one it sends (counted at the sandbox)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from payorch.errors import ProviderIdempotencyError
from payorch.provider import Capability, SubmitRequest, WireRequest
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.providers.sandbox.emulator import SandboxEmulator
from payorch.testing._resends import ResendContract


@pytest.fixture
def emulator() -> Iterator[SandboxEmulator]:
    with SandboxServer() as server:
        yield SandboxEmulator(server)


class _NoWire:
    """Declares replay, cannot say what it sends."""

    name = "sandbox"
    capabilities = frozenset({Capability.REPLAY, Capability.WEBHOOKS})

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)


class _OtherBytes(SandboxProvider):
    """Keeps a request it does not send: another customer than the payload's."""

    def wire_request(self, request: SubmitRequest) -> WireRequest:
        kept = super().wire_request(request)
        return replace(kept, body=kept.body.replace(b'"customer":"cus_', b'"customer":"other_'))


def test_replay_without_wire_request_fails_the_kit() -> None:
    with pytest.raises(AssertionError, match="declares replay but has no wire_request"):
        ResendContract().test_a_replaying_adapter_can_keep_what_it_sends(_NoWire())  # type: ignore[arg-type]


def test_a_kept_request_that_is_not_the_one_sent_fails_the_kit(
    emulator: SandboxEmulator,
) -> None:
    # The sandbox refuses another request under the used key: the check fails, and no
    # second effect is made.
    with (
        _OtherBytes(base_url=emulator.server.url) as adapter,
        pytest.raises(ProviderIdempotencyError, match="another request"),
    ):
        ResendContract().test_the_kept_request_is_the_one_sent_and_sent_again(emulator, adapter)
    assert len(emulator.server.ledger()) == 1  # the first payment only
