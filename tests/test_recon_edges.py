"""Settlement rows at the edges (issue 37): a flag a later row must not clear, a file under
two accounts, an overdue flag acknowledged, an unknown settled with another amount, a
separate capture at Adyen, Adyen's own minor units, a payout without its rows, two imports
judging the same rows, and cells payorch cannot hold. The store is real (SQLite, PostgreSQL,
Citus); files are written as the providers write theirs."""

from __future__ import annotations

from datetime import timedelta

import pytest
from cli_helpers import claim, to_unknown
from test_recon_files import (
    ADYEN_HEADER,
    STRIPE,
    adyen_file,
    adyen_row,
    payout,
    settled,
    state_of,
    succeed,
)

from payorch.core import State
from payorch.errors import SettlementAccountMismatch, SettlementReportInvalid
from payorch.operator import acknowledge
from payorch.provider.settlement import parse_report
from payorch.recon import ReconPolicy, RowClass, import_report
from payorch.recon import _judge as judging
from payorch.recon import _ledger as ledger
from payorch.storage._store import Store


def kinds(store: Store, tenant: str, op_id: str) -> list[str]:
    return [e.kind for e in store.events(tenant, op_id)]


def test_a_duplicate_flag_stays_when_a_later_row_settles_the_operation(store: Store) -> None:
    request = {"amount": 1000, "currency": "EUR"}
    unknown = to_unknown(store, claim(store, "o-1", provider="adyen", request=request))
    first = store.transition(  # answered "pending" with its reference, still unknown
        unknown, State.OUTCOME_UNKNOWN, kind="status_query", actor="r", provider_reference="PSPA"
    )
    second = adyen_file(settled("PSPB", first.downstream_key, "10.00", "9.88"))
    day1 = import_report(store, second, provider="adyen", name="b1.csv")
    assert day1.counts == {"duplicate": 1}
    own = adyen_file(settled("PSPA", first.downstream_key, "10.00", "9.88", batch="8"))
    day3 = import_report(store, own, provider="adyen", name="b2.csv")
    assert day3.counts == {"settles_unknown": 1}
    after = store.get(first.tenant_id, first.id)
    assert after.state is State.SUCCEEDED and after.needs_attention  # the double charge


def test_the_same_file_under_another_account_is_refused(store: Store) -> None:
    import_report(store, STRIPE.encode(), provider="stripe", name="a.csv")
    before = state_of(store)
    with pytest.raises(SettlementAccountMismatch, match="imported before for account ''"):
        import_report(store, STRIPE.encode(), provider="stripe", account="acct_1", name="a.csv")
    assert state_of(store) == before


def test_an_overdue_operation_is_flagged_once_and_never_again_after_an_ack(
    store: Store,
) -> None:
    shown = succeed(store, claim(store, "o-1", provider="stripe"), "pi_1")
    missing = succeed(store, claim(store, "o-2", provider="stripe"), "pi_2")
    past = ReconPolicy(settlement_lag=timedelta(0))
    import_report(store, STRIPE.encode(), provider="stripe", name="a.csv", policy=past)
    assert kinds(store, missing.tenant_id, missing.id).count("settlement_overdue") == 1
    flagged = store.get(missing.tenant_id, missing.id)
    acknowledge(store, flagged.tenant_id, flagged.id, reason="captured later", actor="ops")
    before = state_of(store)
    import_report(store, STRIPE.encode(), provider="stripe", name="a.csv", policy=past)
    assert state_of(store) == before  # the second import changes nothing
    assert "settlement_overdue" not in kinds(store, shown.tenant_id, shown.id)


def test_an_unknown_settled_with_another_amount_is_a_listed_mismatch(store: Store) -> None:
    request = {"amount": 1999, "currency": "EUR"}
    unknown = to_unknown(store, claim(store, "o-1", provider="adyen", request=request))
    data = adyen_file(settled("PSPA", unknown.downstream_key, "199.90", "199.78"))
    result = import_report(store, data, provider="adyen", name="b.csv")
    assert result.counts == {"mismatch": 1}
    after = store.get(unknown.tenant_id, unknown.id)
    assert after.state is State.SUCCEEDED and after.resolution == "settlement"
    assert after.needs_attention
    (verdict,) = result.verdicts
    assert "amount 19990" in verdict.detail["mismatch"]


def test_a_separate_capture_at_adyen_settles_its_own_operation(store: Store) -> None:
    auth = succeed(
        store,
        claim(store, "o-1", provider="adyen", request={"amount": 4200, "currency": "EUR"}),
        "PSPAUTH",
    )
    capture = to_unknown(
        store,
        claim(
            store,
            "c-1",
            provider="adyen",
            operation="payment.capture",
            request={"payment_intent": "PSPAUTH", "amount_to_capture": 3000},
        ),
    )
    row = adyen_row(**{
        "Psp Reference": "PSPAUTH", "Merchant Reference": auth.downstream_key,
        "Creation Date": "2026-11-30 10:15:00", "Type": "Settled",
        "Modification Reference": "PSPCAPTURE",
        "Modification Merchant Reference": capture.downstream_key,
        "Gross Currency": "EUR", "Gross Credit (GC)": "30.00", "Net Currency": "EUR",
        "Net Credit (NC)": "29.70", "Batch Number": "7",
    })  # fmt: skip
    result = import_report(store, adyen_file(row), provider="adyen", name="b.csv")
    assert result.counts == {"settles_unknown": 1}
    after = store.get(capture.tenant_id, capture.id)
    assert after.state is State.SUCCEEDED and after.provider_reference == "PSPCAPTURE"
    assert not store.get(auth.tenant_id, auth.id).needs_attention


def test_adyen_amounts_use_adyens_minor_units() -> None:
    row = settled("PSPA", "k", "1000.00", "1000.00").replace("EUR", "CLP")
    (clp,) = parse_report(adyen_file(row), "b.csv", "adyen").rows
    assert (clp.amount, clp.currency) == (100000, "CLP")  # CLP: 2 decimals at Adyen
    row = settled("PSPA", "k", "1000", "1000").replace("EUR", "IDR").replace(",0.12,", ",,")
    (idr,) = parse_report(adyen_file(row), "b.csv", "adyen").rows
    assert idr.amount == 1000  # IDR: none at Adyen


def test_a_payout_whose_rows_are_in_no_file_yet_is_open(store: Store) -> None:
    balance = (
        "balance_transaction_id,created_utc,currency,gross,fee,net,reporting_category,source_id\n"
        "txn_1,2026-11-30 10:00:00,usd,10.00,0.59,9.41,charge,ch_1\n"
        "txn_2,2026-12-01 00:00:00,usd,-40.00,0.00,-40.00,payout,po_9\n"
    )
    result = import_report(store, balance.encode(), provider="stripe", name="balance.csv")
    assert [(b.batch, b.status, b.difference) for b in result.batches] == [("po_9", "open", None)]


def test_a_row_judged_by_another_import_is_not_judged_again(store: Store) -> None:
    unknown = to_unknown(
        store, claim(store, "o-1", provider="adyen", request={"amount": 1000, "currency": "EUR"})
    )
    data = adyen_file(settled("PSPA", unknown.downstream_key, "10.00", "9.88"), payout("9.88"))
    report = parse_report(data, "b.csv", "adyen")
    ledger.store_report(store, report, "adyen", "")
    # What a second, concurrent import read before the first one judged anything.
    rows = ledger.pending(store, "adyen", "")
    candidates = judging._Candidates(store, "adyen", rows)
    first = judging.judge_pending(store, "adyen", "", ReconPolicy(), "one")
    assert {v.klass for v in first} == {RowClass.SETTLES_UNKNOWN, RowClass.OTHER}
    events = kinds(store, unknown.tenant_id, unknown.id)
    judged = state_of(store)[3]
    late = judging.Judge(store, "adyen", "", ReconPolicy(), "two")
    for row in rows:
        late.judge(row, candidates)
    late.flush()
    assert kinds(store, unknown.tenant_id, unknown.id) == events  # settled once
    assert state_of(store)[3] == judged  # each row keeps the class it was judged first


@pytest.mark.parametrize(
    ("cell", "column", "says"),
    [
        ("99999999999999999999.00", "Gross Credit (GC)", "larger than any payment"),
        ("P" * 300, "Psp Reference", "longer than 255"),
    ],
)
def test_cells_payorch_cannot_hold_are_refused_naming_their_column(
    store: Store, cell: str, column: str, says: str
) -> None:
    values = {"Psp Reference": "PSPA", "Gross Credit (GC)": "10.00"}
    values[column] = cell
    row = adyen_row(**{
        **values, "Merchant Reference": "k", "Creation Date": "2026-11-30 10:15:00",
        "Type": "Settled", "Modification Reference": "PSPM", "Gross Currency": "EUR",
        "Net Currency": "EUR", "Net Credit (NC)": "9.88", "Batch Number": "7",
    })  # fmt: skip
    before = state_of(store)
    with pytest.raises(SettlementReportInvalid) as caught:
        import_report(store, adyen_file(row), provider="adyen", name="b.csv")
    assert (caught.value.row, caught.value.column) == (2, column) and says in caught.value.message
    assert state_of(store) == before
    assert ADYEN_HEADER.startswith("Company Account")


def test_a_date_out_of_range_is_refused() -> None:
    text = STRIPE.replace("2026-11-30 10:00:00", "9999-12-31T23:00:00-05:00")
    with pytest.raises(SettlementReportInvalid, match="out of range"):
        parse_report(text.encode(), "r.csv", "stripe")
