"""Settlement report files (issue 37): read as the providers document them, judged against
operations in every state, refused whole when they cannot be read.

No provider runs here: operations are claimed and moved in the store (SQLite, PostgreSQL,
Citus), and the files are written as Stripe and Adyen write theirs (columns by name, extra
and reordered ones, the newer Adyen layout with its extra columns).
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from cli_helpers import claim, to_unknown

from payorch.core import State
from payorch.errors import SettlementAccountMismatch, SettlementReportInvalid
from payorch.provider.settlement import parse_report
from payorch.recon import RowClass, build_report, import_report
from payorch.records import OperationRecord
from payorch.storage._store import Store
from payorch.storage._tables import events, operations, recon_files, recon_rows

ADYEN_HEADER = (
    "Company Account,Merchant Account,Psp Reference,Merchant Reference,Payment Method,"
    "Creation Date,TimeZone,Type,Modification Reference,Gross Currency,Gross Debit (GC),"
    "Gross Credit (GC),Exchange Rate,Net Currency,Net Debit (NC),Net Credit (NC),"
    "Commission (NC),Markup (NC),Scheme Fees (NC),Interchange (NC),Payment Method Variant,"
    "Modification Merchant Reference,Batch Number,Reserved4,Reserved5,Reserved6,Reserved7,"
    "Reserved8,Reserved9,Reserved10,Booking Date,Booking Date TimeZone,Metadata"
)
MERCHANT = "ShopECOM"


def adyen_row(**cells: str) -> str:
    columns = ADYEN_HEADER.split(",")
    values = {"Company Account": "ShopCompany", "Merchant Account": MERCHANT, "TimeZone": "CET"}
    values.update(cells)
    return ",".join(_quoted(values.get(c, "")) for c in columns)


def _quoted(value: str) -> str:
    return f'"{value}"' if "," in value else value


def settled(ref: str, merchant_ref: str, amount: str, net: str, *, batch: str = "7") -> str:
    return adyen_row(**{
        "Psp Reference": ref, "Merchant Reference": merchant_ref, "Payment Method": "visa",
        "Creation Date": "2026-11-30 10:15:00", "Type": "Settled",
        "Modification Reference": ref.replace("PSP", "MOD"), "Gross Currency": "EUR",
        "Gross Credit (GC)": amount, "Exchange Rate": "1", "Net Currency": "EUR",
        "Net Credit (NC)": net, "Commission (NC)": "0.12", "Batch Number": batch,
    })  # fmt: skip


def payout(amount: str, *, batch: str = "7") -> str:
    return adyen_row(**{
        "Creation Date": "2026-12-01 06:00:00", "Type": "MerchantPayout",
        "Modification Reference": f"TX4411XT batch {batch}, {MERCHANT}", "Net Currency": "EUR",
        "Net Debit (NC)": amount, "Batch Number": batch,
    })  # fmt: skip


def fee(amount: str) -> str:
    return adyen_row(**{
        "Creation Date": "2026-11-30 23:59:00", "Type": "InvoiceDeduction",
        "Modification Reference": "Invoice 2026-11", "Net Currency": "EUR",
        "Net Debit (NC)": amount, "Batch Number": "7",
    })  # fmt: skip


def succeed(store: Store, record: OperationRecord, reference: str) -> OperationRecord:
    return store.transition(
        record,
        State.SUCCEEDED,
        kind="provider_answer",
        actor="worker-1",
        provider_reference=reference,
        response={"status": "succeeded", "http_status": 200},
    )


def fail(store: Store, record: OperationRecord, reference: str) -> OperationRecord:
    return store.transition(
        record,
        State.FAILED_FINAL,
        kind="provider_answer",
        actor="worker-1",
        provider_reference=reference,
        error_code="Refused",
        response={"status": "failed", "http_status": 402},
    )


def table_rows(store: Store, table: sa.Table) -> list[Any]:
    with store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.select(table)).all()]


def state_of(store: Store) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    return (
        sorted(table_rows(store, operations), key=str),
        sorted(table_rows(store, events), key=str),
        table_rows(store, recon_files),
        table_rows(store, recon_rows),
    )


def adyen_file(*rows: str) -> bytes:
    return ("\n".join([ADYEN_HEADER, *rows]) + "\n").encode()


def test_an_adyen_batch_judges_every_row_and_checks_its_total(store: Store) -> None:
    def new(key: str) -> OperationRecord:
        return claim(store, key, provider="adyen", request={"amount": 1000, "currency": "EUR"})

    paid = succeed(store, new("o-1"), "PSP0000000000001")
    unknown = to_unknown(store, new("o-2"))
    failed = fail(store, new("o-3"), "PSP0000000000003")
    other = succeed(store, new("o-4"), "PSP0000000000004")
    data = adyen_file(
        settled("PSP0000000000001", paid.downstream_key, "10.00", "9.88"),
        settled("PSP0000000000002", unknown.downstream_key, "10.00", "9.88"),
        settled("PSP0000000000003", failed.downstream_key, "10.00", "9.88"),
        settled("PSP0000000000004", other.downstream_key, "12.00", "11.88"),
        settled("PSP0000000000005", "someone-elses-reference", "5", "4.88"),
        fee("1.40"),
        payout("45.00"),
    )

    result = import_report(store, data, provider="adyen", account=MERCHANT, name="batch_7.csv")

    assert result.counts == {
        "matched": 1,
        "settles_unknown": 1,
        "contradiction": 1,
        "mismatch": 1,
        "orphan": 1,
        "other": 2,
    }
    settled_now = store.get(unknown.tenant_id, unknown.id)
    assert settled_now.state is State.SUCCEEDED and settled_now.resolution == "settlement"
    assert settled_now.provider_reference == "PSP0000000000002"  # from Psp Reference
    # A final state is never rewritten: flagged for a human, the evidence kept.
    contradicted = store.get(failed.tenant_id, failed.id)
    assert contradicted.state is State.FAILED_FINAL and contradicted.needs_attention
    assert store.events(failed.tenant_id, failed.id)[-1].kind == "settlement_contradiction"
    mismatched = store.get(other.tenant_id, other.id)
    assert mismatched.needs_attention and mismatched.state is State.SUCCEEDED
    assert not store.get(paid.tenant_id, paid.id).needs_attention
    (batch,) = result.batches
    assert (batch.batch, batch.net, batch.paid, batch.status) == ("7", 4500, 4500, "balanced")
    report = build_report(store, provider="adyen")
    orphan = next(r for r in report.listed if r.klass == RowClass.ORPHAN)
    assert orphan.payment_reference == "PSP0000000000005"
    assert orphan.refusal is not None  # an Adyen report carries no tags
    assert {r.klass for r in report.listed} == {"orphan", "contradiction", "mismatch"}


def test_a_batch_whose_rows_do_not_add_up_to_its_payout_is_unbalanced(store: Store) -> None:
    data = adyen_file(settled("PSP0000000000009", "x", "10.00", "9.88"), payout("999.00"))
    result = import_report(store, data, provider="adyen", name="batch_7.csv")
    (batch,) = result.batches
    assert batch.status == "unbalanced" and batch.difference == 988 - 99900
    no_total = import_report(
        store, adyen_file(settled("PSP0000000000010", "y", "1", "1", batch="8")), provider="adyen"
    )
    assert [b.status for b in no_total.batches] == ["open"]


def test_a_file_of_another_merchant_account_is_refused_whole(store: Store) -> None:
    data = adyen_file(settled("PSP0000000000001", "k", "10.00", "9.88"), payout("9.88"))
    before = state_of(store)
    with pytest.raises(SettlementAccountMismatch, match="OtherECOM"):
        import_report(store, data, provider="adyen", account="OtherECOM", name="b.csv")
    assert state_of(store) == before


def test_a_file_of_several_merchant_accounts_is_refused(store: Store) -> None:
    data = adyen_file(
        settled("PSP0000000000001", "k", "10.00", "9.88"),
        settled("PSP0000000000002", "k", "10.00", "9.88").replace(MERCHANT, "OtherECOM"),
    )
    with pytest.raises(SettlementReportInvalid, match="several accounts"):
        import_report(store, data, provider="adyen", name="b.csv")
    assert state_of(store)[2:] == ([], [])


STRIPE = (
    "balance_transaction_id,created_utc,available_on_utc,currency,gross,fee,net,"
    "reporting_category,source_id,description,automatic_payout_id,payment_intent_id\n"
    "txn_1,2026-11-30 10:00:00,2026-12-02 00:00:00,usd,10.00,0.59,9.41,charge,ch_1,Order 1,"
    "po_1,pi_1\n"
    "txn_2,2026-11-30 11:00:00,2026-12-02 00:00:00,usd,-4.00,0.00,-4.00,refund,re_1,Refund,"
    "po_1,pi_1\n"
)

BAD = [
    ("adyen as stripe", adyen_file(payout("1.00")), 1, "header lacks"),
    ("missing net", STRIPE.replace(",net,", ",nett,").encode(), 1, "'net'"),
    ("truncated", STRIPE.encode()[:-40], 3, "cells where the header has"),
    ("open quote", (STRIPE + 'txn_3,"2026-11-30 12:00:00,usd\n').encode(), 4, "CSV"),
    ("amount", STRIPE.replace("9.41", "9.4x").encode(), 2, "'net'"),
    ("decimals", STRIPE.replace("9.41", "9.415").encode(), 2, "more decimals"),
    ("date", STRIPE.replace("2026-11-30 11:00:00", "30/11/2026 11h").encode(), 3, "created_utc"),
    ("currency", STRIPE.replace("usd,-4.00", "usx,-4.00").encode(), 3, "'currency'"),
    ("empty", b"", None, "empty"),
    ("not text", b"\xff\xfe\x00binary", None, "UTF-8"),
]


@pytest.mark.parametrize(("name", "data", "row", "says"), BAD, ids=[b[0] for b in BAD])
def test_a_file_that_cannot_be_read_is_refused_naming_row_and_column(
    store: Store, name: str, data: bytes, row: int | None, says: str
) -> None:
    paid = succeed(store, claim(store, "o-1", provider="stripe"), "pi_1")
    before = state_of(store)
    with pytest.raises(SettlementReportInvalid) as caught:
        import_report(store, data, provider="stripe", name="report.csv")
    assert caught.value.file == "report.csv" and caught.value.row == row
    assert says in caught.value.message and "\n" not in caught.value.message
    assert state_of(store) == before  # all or nothing: nothing of the file
    assert store.get(paid.tenant_id, paid.id).state is State.SUCCEEDED


def test_stripe_columns_are_found_by_name_and_extra_ones_kept() -> None:
    columns = STRIPE.splitlines()[0].split(",")
    order = [*reversed(columns), "customer_facing_amount", "trace_id"]
    lines = [",".join(order)]
    for line in STRIPE.splitlines()[1:]:
        cells = dict(zip(columns, line.split(","), strict=True))
        cells["customer_facing_amount"] = cells["gross"]
        lines.append(",".join(cells.get(c, "x") for c in order))
    report = parse_report(("\n".join(lines) + "\n").encode(), "r.csv", "stripe")
    assert [(r.key, r.entry.value, r.reference, r.net) for r in report.rows] == [
        ("txn_1", "capture", "pi_1", 941),
        ("txn_2", "refund", "re_1", -400),
    ]
    assert report.rows[0].raw["trace_id"] == "x"


def test_amounts_follow_the_currencys_minor_units() -> None:
    text = STRIPE.replace("usd", "jpy").replace("10.00,0.59,9.41", "1000,0,1000")
    text = text.replace("-4.00,0.00,-4.00", "-400,0,-400")
    rows = parse_report(text.encode(), "r.csv", "stripe").rows
    got = [(r.amount, r.net, r.currency) for r in rows]
    assert got == [(1000, 1000, "JPY"), (400, -400, "JPY")]
    with pytest.raises(SettlementReportInvalid, match="more decimals than JPY"):
        parse_report(text.replace("1000,0,1000", "1000.5,0,1000.5").encode(), "r.csv", "stripe")


def test_a_second_import_and_an_overlapping_file_change_nothing(store: Store) -> None:
    succeed(store, claim(store, "o-1", provider="stripe"), "pi_1")
    first = import_report(store, STRIPE.encode(), provider="stripe", name="a.csv")
    assert first.new_rows == 2
    after = state_of(store)
    again = import_report(store, STRIPE.encode(), provider="stripe", name="a.csv")
    assert (again.new_file, again.new_rows, again.verdicts) == (False, 0, ())
    wider = STRIPE + (
        "txn_3,2026-11-30 12:00:00,2026-12-02 00:00:00,usd,1.00,0.00,1.00,charge,ch_3,Order 3,"
        "po_1,pi_3\n"
    )
    overlap = import_report(store, wider.encode(), provider="stripe", name="b.csv")
    assert overlap.new_file and overlap.new_rows == 1
    assert [v.row_key for v in overlap.verdicts] == ["txn_3"]
    assert state_of(store)[0] == after[0]  # the operations: untouched by the known rows
