"""The tools beside the app run the app's own adapters (``PAYORCH_PROVIDERS``), and a re-send
is the request as first sent, byte for byte, whatever the process that re-sends it was told.

Effects are counted at the Adyen-shaped emulator and at the sandbox; the daemon runs as the
``payorch`` command in its own process, as an operator starts it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from cli_helpers import one_error_line, run
from conftest import age, make_due

from payorch.cli._adapters import providers_from
from payorch.core import State
from payorch.execution._executor import Executor, RetryPolicy
from payorch.provider.settlement import Entry, ReportEntry, write_adyen_settlement
from payorch.providers.adyen.emulator import AdyenEmulator
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.storage._store import Store
from payorch.storage._tables import operations
from payorch.testing import Fault

PAYORCH = Path(sys.executable).with_name("payorch")
RETURN_URL = "https://shop.example/checkout/return"
SETTLE_WITHIN = 60.0  # seconds: the daemon's start and one pass, bounded

# The application's module, as a shop writes it: its adapters built from its own settings.
APP = '''
import os
from datetime import timedelta

from payorch.provider import Capability
from payorch.providers.adyen import AdyenProvider
from payorch.providers.sandbox import SandboxProvider


class AcmeGateway:
    """A custom adapter (no environment setting can build it): an acquirer reached through
    the sandbox's API under the name "acme"."""

    name = "acme"
    capabilities = frozenset(
        {Capability.STATUS_BY_REFERENCE, Capability.STATUS_BY_KEY, Capability.VOID_BY_KEY}
    )

    def __init__(self, url):
        self._inner = SandboxProvider(base_url=url, name="acme")

    @property
    def idempotency_window(self):
        return timedelta(hours=24)

    @property
    def max_call_duration(self):
        return self._inner.max_call_duration

    def submit(self, request):
        return self._inner.submit(request)

    def query_status(self, query):
        return self._inner.query_status(query)

    def void(self, request):
        return self._inner.void(request)

    def parse_webhook(self, headers, body):
        return self._inner.parse_webhook(headers, body)

    def close(self):
        self._inner.close()


def providers():
    adapters = []
    if os.environ.get("SHOP_ADYEN_URL"):
        adapters.append(
            AdyenProvider(
                api_key=os.environ["SHOP_ADYEN_KEY"],
                merchant_account=os.environ["SHOP_ADYEN_ACCOUNT"],
                base_url=os.environ["SHOP_ADYEN_URL"],
                return_url="https://shop.example/checkout/return",
                default_currency="EUR",
            )
        )
    if os.environ.get("SHOP_ACME_URL"):
        adapters.append(AcmeGateway(os.environ["SHOP_ACME_URL"]))
    return adapters
'''


@pytest.fixture
def app_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The app's package on the path (as in the app's own directory)."""
    (tmp_path / "shopapp.py").write_text(APP)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("shopapp", None)
    return tmp_path


def app_env(adyen: AdyenEmulator | None = None, acme: str | None = None) -> dict[str, str]:
    env = {"PAYORCH_PROVIDERS": "shopapp:providers"}
    if adyen is not None:
        env.update(
            SHOP_ADYEN_URL=adyen.url,
            SHOP_ADYEN_KEY=adyen.api_key,
            SHOP_ADYEN_ACCOUNT=adyen.merchant_account,
        )
    if acme is not None:
        env["SHOP_ACME_URL"] = acme
    return env


def adyen_settings(emulator: AdyenEmulator) -> dict[str, str]:
    """The environment the tools build Adyen from (which knows no return URL)."""
    return {
        "PAYORCH_ADYEN_API_KEY": emulator.api_key,
        "PAYORCH_ADYEN_MERCHANT_ACCOUNT": emulator.merchant_account,
        "PAYORCH_ADYEN_BASE_URL": emulator.url,
    }


def unknown_adyen_payment(store: Store, emulator: AdyenEmulator, key: str) -> str:
    """A payment the app sent (with its return URL) whose answer was lost, left for the
    reconciler past the notification grace."""
    emulator.inject(Fault.DROP_AFTER_COMMIT)
    with emulator.adapter(return_url=RETURN_URL) as adyen:
        outcome = Executor(
            store=store, providers=[adyen], retry=RetryPolicy(max_attempts=1)
        ).execute(
            tenant_id="shop",
            operation="payment.create",
            idempotency_key=key,
            request=emulator.payload("payment.create", capture_method="automatic"),
            provider="adyen",
        )
    assert outcome.state is State.OUTCOME_UNKNOWN
    age(store, outcome.operation_id, timedelta(minutes=10))  # no notification came
    make_due(store, outcome.operation_id)
    return outcome.operation_id


def payments_sent(emulator: AdyenEmulator) -> int:
    return Counter(r["path"] for r in emulator.received)["/v71/payments"]


def settled(store: Store, tenant: str, op_id: str) -> Any:
    """The operation once it is settled (bounded by SETTLE_WITHIN)."""
    deadline = time.monotonic() + SETTLE_WITHIN
    while time.monotonic() < deadline:  # bounded: the daemon's pass, observed in the store
        record = store.get(tenant, op_id)
        if record.terminal:
            return record
        time.sleep(0.2)
    return store.get(tenant, op_id)


# -- the daemon, started from the CLI with the app's adapters -----------------------------


@pytest.fixture
def daemon_env(db_url: str, app_dir: Path) -> Iterator[dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
    env.update(
        PAYORCH_DATABASE_URL=db_url,
        PAYORCH_METRICS_ADDR="off",
        PAYORCH_RECONCILE_INTERVAL_SECONDS="0.2",
    )
    yield env


def test_the_daemon_replays_an_unknown_adyen_payment_with_the_apps_adapter(
    store: Store, adyen_emulator: AdyenEmulator, daemon_env: dict[str, str], app_dir: Path
) -> None:
    op_id = unknown_adyen_payment(store, adyen_emulator, "adyen-daemon-1")
    key = store.get("shop", op_id).downstream_key
    daemon = subprocess.Popen(
        [str(PAYORCH), "reconcile", "run"],
        env={**daemon_env, **app_env(adyen_emulator)},
        cwd=app_dir,  # the app's directory: shopapp is found from it
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        record = settled(store, "shop", op_id)
    finally:
        daemon.send_signal(signal.SIGTERM)
        _, stderr = daemon.communicate(timeout=30)
    assert daemon.returncode == 0, stderr
    assert record.state is State.SUCCEEDED and record.resolution == "replay", stderr
    assert adyen_emulator.effects(key) == 1  # the replay answered the first payment
    assert payments_sent(adyen_emulator) == 2  # the first, and its identical replay


# -- a re-send is the request as first sent ---------------------------------------------


def test_a_replay_by_an_adapter_built_from_other_settings_is_the_request_first_sent(
    db_url: str, store: Store, adyen_emulator: AdyenEmulator
) -> None:
    """Without PAYORCH_PROVIDERS the tools build Adyen from the environment, which knows no
    return URL: the replay is still the app's request, byte for byte, and settles it."""
    op_id = unknown_adyen_payment(store, adyen_emulator, "adyen-env-1")
    key = store.get("shop", op_id).downstream_key
    env = adyen_settings(adyen_emulator)
    result = run(db_url, "reconcile", "once", "--json", env=env)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["outcomes"] == {"replayed_succeeded": 1}
    record = store.get("shop", op_id)
    assert record.state is State.SUCCEEDED and record.resolution == "replay"
    assert adyen_emulator.effects(key) == 1
    # The emulator answers 422 (704) to another request under a used key, as Adyen does:
    # the replay was the first request.
    assert payments_sent(adyen_emulator) == 2


def test_an_operation_whose_first_request_was_not_kept_is_never_re_sent(
    db_url: str, store: Store, adyen_emulator: AdyenEmulator
) -> None:
    """A rebuilt request could differ from the first (here: no return URL): none is sent,
    nothing is recorded as the operation's outcome, and a human is asked."""
    op_id = unknown_adyen_payment(store, adyen_emulator, "adyen-lost-1")
    with store.engine.begin() as conn:  # as for an operation claimed before requests were kept
        o = operations.c  # the claim's event is kept on the row (claim_event)
        conn.execute(
            sa.update(operations)
            .where(o.id == op_id)
            .values(claim_event={"actor": "app", "detail": {}})
        )
    sent = len(adyen_emulator.received)
    env = adyen_settings(adyen_emulator)
    result = run(db_url, "reconcile", "once", "--json", env=env)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["outcomes"] == {"escalated": 1}
    record = store.get("shop", op_id)
    assert record.state is State.OUTCOME_UNKNOWN and record.needs_attention
    assert len(adyen_emulator.received) == sent  # nothing re-sent


def test_a_request_that_hides_a_sensitive_value_keeps_no_wire_request(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    """The wire request would hold the secret the stored request hides: not kept."""
    from pydantic import BaseModel

    from payorch.operations import OperationType, default_registry

    class Card(BaseModel):
        amount: int
        currency: str
        card_number: str

    registry = default_registry("sandbox")
    registry.register(
        OperationType(
            name="card.charge",
            model=Card,
            effect_fields=("amount", "currency"),
            sensitive_fields=("card_number",),
            provider="sandbox",
        )
    )
    outcome = Executor(store=store, providers=[sandbox_provider], registry=registry).execute(
        tenant_id="shop",
        operation="card.charge",
        idempotency_key="card-1",
        request={"amount": 100, "currency": "EUR", "card_number": "4242424242424242"},
    )
    details = [e.detail for e in store.events("shop", outcome.operation_id)]  # rows and kept
    text = json.dumps(details)
    assert "4242424242424242" not in text and '"wire"' not in text
    assert len(sandbox.effects_for(store.get("shop", outcome.operation_id).downstream_key)) == 1


# -- a custom adapter, from the CLI ----------------------------------------------------


def test_a_custom_adapters_operation_is_rechecked_and_voided_from_the_cli(
    db_url: str, store: Store, sandbox: SandboxServer, app_dir: Path
) -> None:
    import shopapp  # type: ignore[import-not-found]

    acme = shopapp.AcmeGateway(sandbox.url)
    try:
        check_from_the_cli(db_url, store, sandbox, acme)
    finally:
        acme.close()


def check_from_the_cli(db_url: str, store: Store, sandbox: SandboxServer, acme: Any) -> None:
    executor = Executor(store=store, providers=[acme], retry=RetryPolicy(max_attempts=1))

    def unknown(key: str, **extra: Any) -> str:
        sandbox.inject("error_500_after")
        outcome = executor.execute(
            tenant_id="shop",
            operation="payment.create",
            idempotency_key=key,
            request={"amount": 700, "currency": "EUR", **extra},
            provider="acme",
        )
        assert outcome.state is State.OUTCOME_UNKNOWN
        make_due(store, outcome.operation_id)
        return outcome.operation_id

    paid = unknown("acme-1")
    held = unknown("acme-2", capture_method="manual")
    # Without the app's adapters the tools cannot reach "acme": refused, in one line.
    refused = run(db_url, "ops", "recheck", paid, "--actor", "alice")
    assert refused.exit_code == 1
    assert "PAYORCH_PROVIDERS" in one_error_line(refused)
    assert store.get("shop", paid).state is State.OUTCOME_UNKNOWN

    env = app_env(acme=sandbox.url)
    rechecked = run(db_url, "ops", "recheck", paid, "--actor", "alice", env=env)
    assert rechecked.exit_code == 0, rechecked.output
    assert store.get("shop", paid).state is State.SUCCEEDED
    voided = run(
        db_url, "ops", "void", held, "--actor", "alice", "--reason", "customer left", env=env
    )
    assert voided.exit_code == 0, voided.output
    record = store.get("shop", held)
    assert record.resolution in ("void", "void_requested"), record
    for op_id in (paid, held):  # one effect each: none added by the recheck or the void
        assert len(sandbox.effects_for(store.get("shop", op_id).downstream_key)) == 1
    (voided_effect,) = sandbox.effects_for(record.downstream_key)
    assert voided_effect["status"] == "voided"


# -- provider settings are read only by the commands that need them -----------------------


def test_a_bad_adyen_setting_stops_only_the_commands_that_call_adyen(db_url: str) -> None:
    not_hex = {
        "PAYORCH_ADYEN_API_KEY": "AQE_key",
        "PAYORCH_ADYEN_MERCHANT_ACCOUNT": "ShopECOM",
        "PAYORCH_ADYEN_BASE_URL": "http://127.0.0.1:9/v71",
        "PAYORCH_ADYEN_HMAC_KEY": "not-hex",
    }
    # The HMAC key verifies notifications, which no command does: a warning, no refusal.
    assert run(db_url, "ops", "list", env=not_hex).exit_code == 0
    once = run(db_url, "reconcile", "once", env=not_hex)
    assert once.exit_code == 0, once.output
    assert "PAYORCH_ADYEN_HMAC_KEY" in once.stderr
    # A setting a provider call needs stops the commands that call it, and no other.
    no_account = {
        "PAYORCH_ADYEN_API_KEY": "AQE_key",
        "PAYORCH_STRIPE_IDEMPOTENCY_WINDOW_SECONDS": "x",
    }
    assert run(db_url, "ops", "list", env=no_account).exit_code == 0
    assert run(db_url, "stats", env=no_account).exit_code == 0
    refused = run(db_url, "reconcile", "once", env=no_account)
    assert refused.exit_code == 1
    assert "PAYORCH_STRIPE_IDEMPOTENCY_WINDOW_SECONDS" in one_error_line(refused)


def test_providers_that_are_not_adapters_are_refused_in_one_line(
    db_url: str, app_dir: Path
) -> None:
    (app_dir / "badapp.py").write_text("providers = ['not an adapter']\nempty = []\n")
    for target, said in [
        ("badapp:providers", "str is not a provider adapter"),
        ("badapp:empty", "nothing is a provider adapter"),
        ("badapp:missing", "cannot load"),
        ("nosuchmodule:providers", "cannot load"),
    ]:
        result = run(db_url, "reconcile", "once", env={"PAYORCH_PROVIDERS": target})
        assert result.exit_code == 1, result.output
        line = one_error_line(result)
        assert "PAYORCH_PROVIDERS" in line and said in line, line


def test_the_hook_may_name_the_apps_integration(
    db_url: str,
    store: Store,
    sandbox: SandboxServer,
    sandbox_provider: SandboxProvider,
    app_dir: Path,
) -> None:
    """``PAYORCH_PROVIDERS=shop:payorch``: the Flask extension the app built holds its
    adapters; the tools run those."""
    (app_dir / "flaskshop.py").write_text(
        "import os\n"
        "from payorch.integrations.flask import Payorch\n"
        "from payorch.providers.sandbox import SandboxProvider\n"
        "payorch = Payorch(url=os.environ['SHOP_DB'], providers=[SandboxProvider(\n"
        "    base_url=os.environ['SHOP_SANDBOX'], webhook_secret=os.environ['SHOP_SECRET'])])\n"
        "def create_app():\n"
        "    return payorch\n"
    )
    sandbox.inject("error_500_after")
    outcome = Executor(
        store=store, providers=[sandbox_provider], retry=RetryPolicy(max_attempts=1)
    ).execute(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key="flask-1",
        request={"amount": 900, "currency": "EUR"},
        provider="sandbox",
    )
    assert outcome.state is State.OUTCOME_UNKNOWN
    make_due(store, outcome.operation_id)
    env = {
        "PAYORCH_PROVIDERS": "flaskshop:payorch",
        "PAYORCH_SANDBOX_URL": "http://127.0.0.1:9",  # not read: the app's adapters are
        "SHOP_DB": db_url,
        "SHOP_SANDBOX": sandbox.url,
        "SHOP_SECRET": sandbox.webhook_secret,
    }
    result = run(db_url, "reconcile", "once", "--json", env=env)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["outcomes"] == {"succeeded": 1}
    record = store.get("shop", outcome.operation_id)
    assert record.state is State.SUCCEEDED
    assert len(sandbox.effects_for(record.downstream_key)) == 1
    # A factory that returns the integration it built is read the same way.
    import flaskshop  # type: ignore[import-not-found]

    (adapter,) = providers_from(flaskshop.create_app, "PAYORCH_PROVIDERS")
    assert adapter is flaskshop.payorch.providers[0]
    flaskshop.payorch.close()
    sys.modules.pop("flaskshop", None)


def test_recon_import_checks_files_against_the_apps_adyen_merchant_account(
    app_dir: Path, db_url: str, adyen_emulator: AdyenEmulator, tmp_path: Path
) -> None:
    """The account a settlement file must be for is the app's adapter's, not an option."""
    paid = ReportEntry(
        entry=Entry.CAPTURE,
        reference="PSP0000000000001",
        amount=1000,
        currency="EUR",
        created_at=datetime.now(UTC),
    )
    ours = tmp_path / "settlement_detail_report_batch_1.csv"
    account = adyen_emulator.merchant_account
    ours.write_bytes(write_adyen_settlement([paid], merchant_account=account, batch=1))
    theirs = tmp_path / "settlement_detail_report_batch_2.csv"
    theirs.write_bytes(write_adyen_settlement([paid], merchant_account="ElseECOM", batch=2))
    env = app_env(adyen_emulator)

    refused = run(db_url, "recon", "import", "--provider", "adyen", str(theirs), env=env)
    assert refused.exit_code == 1
    assert f"not {adyen_emulator.merchant_account!r}" in one_error_line(refused)
    accepted = run(db_url, "recon", "import", "--provider", "adyen", str(ours), env=env)
    assert accepted.exit_code == 0, accepted.output
