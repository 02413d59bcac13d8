"""The Stripe- and Adyen-shaped emulators write their ledgers as the providers' settlement
reports (``settlement_report``), and ``payorch.recon`` reads them back: one row per money
movement, named by the reference payorch's adapter stored for the operation that made it,
nothing for what moved no money, and each batch balanced by its payout.

Payments go through payorch's adapters against the emulators on loopback.
"""

from __future__ import annotations

from typing import Any

from payorch.provider import Answer, AnswerKind, SubmitRequest
from payorch.provider.settlement import Entry, ParsedReport, SettlementRow, parse_report
from payorch.providers.adyen import AdyenProvider
from payorch.providers.adyen.emulator import AdyenEmulator
from payorch.providers.stripe import StripeProvider
from payorch.providers.stripe.emulator import StripeEmulator
from payorch.testing import Fault
from payorch.testing._requests import submit_request


def send(
    adapter: StripeProvider | AdyenProvider,
    payload: dict[str, Any],
    operation: str = "payment.create",
    kind: AnswerKind = AnswerKind.SUCCEEDED,
) -> tuple[SubmitRequest, str]:
    """``payload`` submitted as payorch submits it; the request and the reference stored."""
    request = submit_request(payload, operation=operation)
    answer: Answer = adapter.submit(request)
    assert answer.kind is kind, answer
    assert answer.provider_reference is not None
    return request, answer.provider_reference


def rows(report: ParsedReport, entry: Entry) -> list[SettlementRow]:
    return [r for r in report.rows if r.entry is entry]


def named(report: ParsedReport) -> set[str]:
    """Every reference a row names, as its own or its payment's."""
    return {ref for r in report.rows for ref in (r.reference, r.payment_reference) if ref}


def assert_balanced(report: ParsedReport, batch: str, paid_out: int) -> None:
    assert {r.batch for r in report.rows} == {batch}
    (payout,) = rows(report, Entry.PAYOUT)
    assert payout.net == -paid_out
    assert sum(r.net for r in report.rows) == 0


# -- Stripe ------------------------------------------------------------------------------------


def test_the_stripe_report_names_each_effect_by_the_id_payorch_stores(
    stripe_emulator: StripeEmulator,
) -> None:
    emu, adapter = stripe_emulator, stripe_emulator.adapter()
    paid_req, paid = send(adapter, emu.payload("payment.create", metadata={"order": "17"}))
    _, declined = send(
        adapter,
        emu.payload("payment.create", payment_method="pm_card_chargeDeclined"),
        kind=AnswerKind.DECLINED,
    )
    held_req, held = send(adapter, emu.payload("payment.create", capture_method="manual"))
    capture = {"payment_intent": held, "amount_to_capture": 1500}
    _, captured = send(adapter, capture, "payment.capture")
    _, uncaptured = send(adapter, emu.payload("payment.create", capture_method="manual"))
    refund_req, refund = send(adapter, {"payment_intent": paid, "amount": 500}, "refund.create")
    assert captured == held and refund.startswith("re_")

    report = parse_report(emu.settlement_report(), "stripe.csv", "stripe")

    assert report.format == "stripe" and report.kind == "payout_reconciliation"
    assert sorted(
        (r.reference, r.payment_reference, r.amount, r.currency, dict(r.tags))
        for r in rows(report, Entry.CAPTURE)
    ) == sorted(
        [
            (paid, paid, 2000, "USD", dict(paid_req.tags)),
            (held, held, 1500, "USD", dict(held_req.tags)),  # the amount captured
        ]
    )
    (refunded,) = rows(report, Entry.REFUND)
    assert (refunded.reference, refunded.payment_reference) == (refund, paid)
    assert (refunded.amount, refunded.currency, refunded.net) == (500, "USD", -500)
    assert dict(refunded.tags) == dict(refund_req.tags)
    assert declined not in named(report) and uncaptured not in named(report)
    assert b"order" not in emu.settlement_report()  # only payorch's tags are reported
    assert_balanced(report, "po_emulator_1", 2000 + 1500 - 500)


def test_the_stripe_report_takes_fees_and_a_batch_and_can_leave_effects_out(
    stripe_emulator: StripeEmulator,
) -> None:
    emu, adapter = stripe_emulator, stripe_emulator.adapter()
    _, first = send(adapter, emu.payload("payment.create"))
    _, second = send(adapter, emu.payload("payment.create", amount=5000))

    data = emu.settlement_report(batch=7, fee=lambda amount: 30 + amount // 100, effects={second})
    report = parse_report(data, "stripe.csv", "stripe")

    (charge,) = rows(report, Entry.CAPTURE)
    assert (charge.reference, charge.amount, charge.fee, charge.net) == (second, 5000, 80, 4920)
    assert first not in named(report)
    assert_balanced(report, "po_emulator_7", 4920)
    named_batch = parse_report(emu.settlement_report(batch="po_day_2"), "s.csv", "stripe")
    assert_balanced(named_batch, "po_day_2", 2000 + 5000)


# -- Adyen -------------------------------------------------------------------------------------


def test_the_adyen_report_names_each_effect_by_the_psp_reference_payorch_stores(
    adyen_emulator: AdyenEmulator, adyen_provider: AdyenProvider
) -> None:
    emu, adapter = adyen_emulator, adyen_provider
    paid_req, paid = send(adapter, emu.payload("payment.create", capture_method="automatic"))
    emu.inject(Fault.DECLINE)
    _, declined = send(adapter, emu.payload("payment.create"), kind=AnswerKind.DECLINED)
    held_req, held = send(adapter, emu.payload("payment.create", amount=3000))
    capture = {"payment_intent": held, "amount_to_capture": 2500}  # in the default EUR
    _, capture_psp = send(adapter, capture, "payment.capture", AnswerKind.PENDING)
    _, uncaptured = send(adapter, emu.payload("payment.create"))
    refund = {"payment_intent": paid, "amount": 400, "currency": "EUR"}
    refund_req, refunded_psp = send(adapter, refund, "refund.create", AnswerKind.PENDING)
    too_much = {"payment_intent": held, "amount": 9000, "currency": "EUR"}
    _, failed_psp = send(adapter, too_much, "refund.create", AnswerKind.PENDING)

    report = parse_report(emu.settlement_report(), "settlement.csv", "adyen")

    assert report.format == "adyen" and report.account == emu.merchant_account
    # A Settled row names the payment (its Psp Reference), as Adyen's report does, and a
    # separate capture by its own (Modification Reference): what payment.capture stores.
    captured = {r.payment_reference: r for r in rows(report, Entry.CAPTURE)}
    assert sorted(
        (r.payment_reference, r.merchant_reference, r.amount, r.currency) for r in captured.values()
    ) == sorted(
        [
            (paid, paid_req.downstream_key, 1000, "EUR"),
            (held, held_req.downstream_key, 2500, "EUR"),  # the amount captured
        ]
    )
    assert captured[held].reference == capture_psp
    (refunded,) = rows(report, Entry.REFUND)
    assert (refunded.reference, refunded.payment_reference) == (refunded_psp, paid)
    assert refunded.merchant_reference == refund_req.downstream_key
    assert refunded.raw["Merchant Reference"] == paid_req.downstream_key
    assert (refunded.amount, refunded.currency, refunded.net) == (400, "EUR", -400)
    assert all(not r.tags for r in report.rows)  # Adyen's report has no metadata
    refused = {declined, uncaptured, failed_psp}
    assert refused.isdisjoint(named(report))
    assert_balanced(report, "1", 1000 + 2500 - 400)


def test_the_adyen_report_takes_fees_and_a_batch_and_can_leave_effects_out(
    adyen_emulator: AdyenEmulator, adyen_provider: AdyenProvider
) -> None:
    emu, adapter = adyen_emulator, adyen_provider
    _, first = send(adapter, emu.payload("payment.create", capture_method="automatic"))
    second_payload = emu.payload("payment.create", capture_method="automatic", amount=5000)
    _, second = send(adapter, second_payload)

    data = emu.settlement_report(batch=12, fee=lambda amount: 12 + amount // 100, effects={second})
    report = parse_report(data, "settlement_detail_report_batch_12.csv", "adyen")

    (settled,) = rows(report, Entry.CAPTURE)
    got = (settled.payment_reference, settled.amount, settled.fee, settled.net)
    assert got == (second, 5000, 62, 4938)
    assert first not in named(report)
    assert_balanced(report, "12", 4938)
