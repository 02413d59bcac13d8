"""Settlement reports of the Stripe-shaped and the Adyen-shaped emulators, imported (issue 37):
payments made through payorch's own adapters on loopback, one left unknown by an answer
dropped after the commit, one refunded, one declined; the emulator's report of its ledger
settles the unknown (``resolution=settlement``), matches the rest, balances its batch, and a
second import changes nothing. Effects are counted at the emulator."""

from __future__ import annotations

from typing import Any

import pytest

from payorch.core import State
from payorch.errors import SettlementAccountMismatch
from payorch.execution._executor import Executor, RetryPolicy
from payorch.outcome import Outcome
from payorch.recon import import_report
from payorch.storage._store import Store
from payorch.testing import Emulator, Fault

TENANT = "shop"


@pytest.fixture(params=["stripe", "adyen"])
def emulator(request: pytest.FixtureRequest) -> Emulator:
    emu: Emulator = request.getfixturevalue(f"{request.param}_emulator")
    return emu


def test_the_emulators_report_settles_the_day(store: Store, emulator: Emulator) -> None:
    with emulator.adapter() as adapter:
        executor = Executor(store=store, providers=[adapter], retry=RetryPolicy(max_attempts=1))

        def run(operation: str, key: str, request: dict[str, Any]) -> Outcome:
            return executor.execute(
                tenant_id=TENANT,
                operation=operation,
                idempotency_key=key,
                request=request,
                provider=adapter.name,
            )

        payment = emulator.payload("payment.create", capture_method="automatic")
        paid = run("payment.create", "order-1", payment)
        emulator.inject(Fault.DROP_AFTER_COMMIT)
        unknown = run("payment.create", "order-2", payment)
        emulator.inject(Fault.DECLINE)
        declined = run("payment.create", "order-3", payment)
        refund = {
            "payment_intent": paid.provider_reference,
            "amount": 500,
            "currency": payment["currency"],
        }
        refunded = run("refund.create", "refund-1", refund)
    assert unknown.state is State.OUTCOME_UNKNOWN and declined.state is State.FAILED_FINAL
    assert refunded.state in (State.SUCCEEDED, State.OUTCOME_UNKNOWN)  # Adyen: pending
    account = getattr(emulator, "merchant_account", None)
    data = emulator.settlement_report(fee=lambda amount: amount // 50)  # type: ignore[attr-defined]

    result = import_report(store, data, provider=adapter.name, account=account)

    assert result.counts == {"matched": 1, "settles_unknown": 2, "other": 1} or (
        refunded.state is State.SUCCEEDED
        and result.counts == {"matched": 2, "settles_unknown": 1, "other": 1}
    ), result.counts
    settled = store.get(TENANT, unknown.operation_id)
    assert settled.state is State.SUCCEEDED and settled.resolution == "settlement"
    refund_op = store.get(TENANT, refunded.operation_id)
    assert refund_op.state is State.SUCCEEDED
    assert store.get(TENANT, declined.operation_id).state is State.FAILED_FINAL
    assert [b.status for b in result.batches] == ["balanced"]
    assert result.expected.items == ()
    for outcome in (paid, unknown):
        assert emulator.effects(store.get(TENANT, outcome.operation_id).downstream_key) == 1
    assert emulator.effects(store.get(TENANT, declined.operation_id).downstream_key) == 0

    again = import_report(store, data, provider=adapter.name, account=account)
    assert (again.new_file, again.new_rows, again.verdicts) == (False, 0, ())
    if account is not None:  # Adyen's rows name their merchant account
        with pytest.raises(SettlementAccountMismatch):
            import_report(store, data, provider=adapter.name, account="SomeoneElseECOM")
