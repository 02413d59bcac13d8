"""The executor's redactor shortcut: taken only where the stored copy hides nothing, so a
registry's own ``Prepared`` and a caller's literal ``[redacted]`` are redacted as ever."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from test_redaction import CARD_CHARGE, SECRETS, charge, dump

from payorch.core import State
from payorch.execution._executor import Executor
from payorch.operations import REDACTED, Prepared, Registry, default_registry
from payorch.providers.sandbox import SandboxProvider
from payorch.records import Redactor
from payorch.storage._store import Store


def test_a_prepared_request_without_a_redactor_is_redacted_as_ever(
    store: Store, sandbox_provider: SandboxProvider
) -> None:
    """A registry that builds its ``Prepared`` itself (no ``redactor``, as before there was
    one): what the provider echoes is still hidden, the redactor derived from the stored
    copy."""

    class OwnRegistry(Registry):
        def prepare(self, **kwargs: Any) -> Prepared:
            made = super().prepare(**kwargs)
            return Prepared(new=made.new, payload=made.payload, effect=made.effect, type=made.type)

    own = OwnRegistry()
    own.register(CARD_CHARGE)
    executor = Executor(
        store=store, providers=[sandbox_provider], registry=own, lease=timedelta(seconds=30)
    )
    outcome = executor.execute(
        tenant_id="shop", operation="card.charge", idempotency_key="own-1", request=charge("own-1")
    )
    assert outcome.state is State.SUCCEEDED
    text = dump(store)
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} found in the database"
    assert "own-1" in text and REDACTED in text


def test_the_executor_derives_the_redactor_unless_nothing_is_hidden() -> None:
    reg = default_registry("sandbox")
    reg.register(CARD_CHARGE)
    plain = {"amount": 500, "currency": "EUR", "customer": "cus_1"}
    made = reg.prepare(
        tenant_id="t", operation="payment.create", idempotency_key="k1", request=plain
    )
    assert made.redactor == Redactor()
    # The caller's own "[redacted]" text, or a request with secrets: derived as ever (None).
    quoted = {**plain, "metadata": {"note": "[redacted]"}}
    made = reg.prepare(
        tenant_id="t", operation="payment.create", idempotency_key="k2", request=quoted
    )
    assert made.redactor is None
    made = reg.prepare(
        tenant_id="t", operation="card.charge", idempotency_key="k3", request=charge("k3")
    )
    assert made.redactor is None
