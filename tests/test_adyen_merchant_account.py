"""Adyen notifications for another merchant account (issue 34): an item whose
``merchantAccountCode`` is not the adapter's merchant account is refused alone, as an item
with a bad HMAC is (not applied, counted as rejected, the delivery answered 400), however
well it is signed: a webhook set up at company level sends every account's items under one
key. The Adyen emulator runs on loopback; the store is real (SQLite and PostgreSQL).
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from adyen_emulator import AdyenEmulator

from payorch.core import State
from payorch.errors import WebhookRejected, WebhookSignatureInvalid
from payorch.execution._executor import Executor, RetryPolicy
from payorch.providers.adyen import AdyenProvider
from payorch.reconciling._webhooks import WebhookHandler
from payorch.storage._store import Store
from payorch.storage._tables import webhook_inbox
from payorch.testing import Fault

TENANT = "shop"
OTHER_ACCOUNT = "SomeoneElsesECOM"


def unknown_payment(store: Store, emulator: AdyenEmulator, key: str) -> str:
    """A payment.create authorised at Adyen whose answer was lost: outcome_unknown."""
    emulator.inject(Fault.DROP_AFTER_COMMIT)
    with emulator.adapter() as adyen:
        outcome = Executor(
            store=store, providers=[adyen], retry=RetryPolicy(max_attempts=1)
        ).execute(
            tenant_id=TENANT,
            operation="payment.create",
            idempotency_key=key,
            request=emulator.payload("payment.create"),
            provider="adyen",
        )
    assert outcome.state is State.OUTCOME_UNKNOWN
    return outcome.operation_id


def authorisation(emulator: AdyenEmulator, downstream_key: str) -> dict[str, Any]:
    (item,) = [
        i
        for i in emulator.notifications()
        if i["merchantReference"] == downstream_key and i["eventCode"] == "AUTHORISATION"
    ]
    return item


def inbox(store: Store) -> list[str]:
    with store.engine.connect() as conn:
        return list(conn.execute(sa.select(webhook_inbox.c.event_id)).scalars())


def test_an_item_of_another_merchant_account_is_refused_alone(
    store: Store, adyen_emulator: AdyenEmulator
) -> None:
    op_id = unknown_payment(store, adyen_emulator, "order-acct")
    key = store.get(TENANT, op_id).downstream_key
    ours = authorisation(adyen_emulator, key)
    assert ours["merchantAccountCode"] == adyen_emulator.merchant_account
    # The same item, as another account's would come: signed with the same key, and valid.
    theirs = {**ours, "merchantAccountCode": OTHER_ACCOUNT, "pspReference": "OTHER0000000001"}

    with adyen_emulator.adapter() as adyen:
        handler = WebhookHandler(store=store, providers=[adyen])
        refused = handler.handle_delivery(TENANT, "adyen", *adyen_emulator.sign([theirs]))

        assert refused.results == () and refused.http_status == 400
        ((index, error),) = refused.rejected
        assert index == 0 and isinstance(error, WebhookRejected)
        assert not isinstance(error, WebhookSignatureInvalid)  # the signature is good
        assert OTHER_ACCOUNT in error.message and adyen_emulator.merchant_account in error.message
        record = store.get(TENANT, op_id)
        assert record.state is State.OUTCOME_UNKNOWN and record.provider_reference is None
        assert inbox(store) == []  # not taken: nothing to dedupe a later delivery against

        # In one delivery with ours: ours is applied, the other account's refused alone.
        both = handler.handle_delivery(TENANT, "adyen", *adyen_emulator.sign([ours, theirs]))

    assert [r.status.value for r in both.results] == ["applied"]
    assert [i for i, _ in both.rejected] == [1] and both.http_status == 400
    settled = store.get(TENANT, op_id)
    assert settled.state is State.SUCCEEDED
    assert settled.provider_reference == ours["pspReference"]
    assert inbox(store) == [f"{ours['pspReference']}:AUTHORISATION:true"]
    assert adyen_emulator.effects(key) == 1


def test_the_adapter_refuses_an_item_of_another_account_or_of_none(
    adyen_emulator: AdyenEmulator, adyen_provider: AdyenProvider
) -> None:
    item: dict[str, Any] = {
        "amount": {"currency": "EUR", "value": 1000},
        "eventCode": "AUTHORISATION",
        "eventDate": "2026-01-10T13:40:54+01:00",
        "merchantReference": "order-17",
        "pspReference": "993617895204576J",
        "success": "true",
    }
    mine = {**item, "merchantAccountCode": adyen_emulator.merchant_account}
    other = {**item, "merchantAccountCode": OTHER_ACCOUNT}

    batch = adyen_provider.parse_webhooks(*adyen_emulator.sign([mine, other, item]))

    assert batch.items[0].event is not None
    for refused in batch.items[1:]:  # another account's, and one naming no account
        assert refused.event is None and isinstance(refused.rejected, WebhookRejected)
        assert "merchant account" in refused.rejected.message
    with pytest.raises(WebhookRejected, match=OTHER_ACCOUNT):
        adyen_provider.parse_webhook(*adyen_emulator.sign([other]))
