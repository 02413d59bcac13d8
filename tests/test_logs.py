"""Structured log lines: stable events with fields, never a key or a body; the CLI's
``--log-format json`` prints one JSON object per line."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import make_due

from payorch.core import State
from payorch.errors import IdempotencyKeyReused, WebhookSignatureInvalid
from payorch.execution._executor import Executor
from payorch.observing import _logs as logs
from payorch.operations import default_registry
from payorch.providers.sandbox import Fault, SandboxProvider, SandboxServer
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.reconciling._webhooks import WebhookHandler
from payorch.storage._store import Store

PAYORCH = Path(sys.executable).with_name("payorch")
KEY = "order-secret-key-31337"
SECRET_CUSTOMER = "cus_private_4242"
PAYMENT = {"amount": 98765, "currency": "EUR", "customer": SECRET_CUSTOMER}


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == name]


def assert_nothing_secret(records: list[logging.LogRecord], *secrets: str) -> None:
    for record in records:
        text = record.getMessage() + " " + " ".join(map(str, record.__dict__.values()))
        for secret in secrets:
            assert secret not in text, (secret, record.getMessage())


def test_execute_logs_attempts_and_the_transition_with_fields_and_no_secrets(
    executor: Executor, sandbox: SandboxServer, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    sandbox.inject(Fault.RATE_LIMIT)
    with caplog.at_level(logging.DEBUG, logger="payorch"):
        outcome = executor.execute(
            tenant_id="shop", operation="payment.create", idempotency_key=KEY, request=PAYMENT
        )
        with pytest.raises(IdempotencyKeyReused):
            executor.execute(
                tenant_id="shop",
                operation="payment.create",
                idempotency_key=KEY,
                request={**PAYMENT, "amount": 1},
            )
    assert outcome.state is State.SUCCEEDED
    first, second = events(caplog, "attempt.answered")
    assert (first.attempt, first.answer_kind, first.possibly_sent) == (1, "not_sent", False)
    assert (second.attempt, second.answer_kind, second.possibly_sent) == (2, "succeeded", True)
    [retry] = events(caplog, "attempt.retrying")
    assert retry.levelno == logging.INFO and retry.code == "rate_limited"
    moves = [
        (r.from_state, r.to_state, r.event_kind) for r in events(caplog, "operation.transition")
    ]
    assert moves == [
        ("in_progress", "in_progress", "attempt"),
        ("in_progress", "succeeded", "provider_answer"),
    ]
    final = events(caplog, "operation.transition")[-1]
    assert final.name == "payorch.executor"
    assert final.operation_id == outcome.operation_id
    assert final.tenant_id == "shop" and final.provider == "sandbox"
    assert final.getMessage().startswith("operation.transition operation_id=")
    [refused] = events(caplog, "execute.refused")
    assert refused.levelno == logging.INFO and refused.error == "IdempotencyKeyReused"
    assert refused.http_status == 422
    downstream = store.get("shop", outcome.operation_id).downstream_key
    assert_nothing_secret(caplog.records, KEY, downstream, SECRET_CUSTOMER, "98765")


def test_escalation_is_a_warning_with_the_reason(
    store: Store,
    sandbox: SandboxServer,
    sandbox_provider: SandboxProvider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    executor = Executor(
        store=store,
        providers=[sandbox_provider],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
    )
    sandbox.inject(Fault.ERROR_500_BEFORE)  # possibly sent as far as we know; nothing there
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key=KEY, request=PAYMENT
    )
    assert outcome.state is State.OUTCOME_UNKNOWN
    make_due(store, outcome.operation_id)
    reconciler = Reconciler(
        store=store,
        providers=[sandbox_provider],
        policy=ReconcilerPolicy(lease=timedelta(seconds=30), max_checks=1),
    )
    with caplog.at_level(logging.DEBUG, logger="payorch"):
        report = reconciler.reconcile_once()
    assert report.outcomes == {"not_found_waiting": 1}
    [warning] = events(caplog, "operation.needs_attention")
    assert warning.levelno == logging.WARNING and warning.name == "payorch.reconciler"
    assert warning.operation_id == outcome.operation_id
    assert warning.reason.startswith("1 checks")
    assert store.get("shop", outcome.operation_id).needs_attention
    [checked] = events(caplog, "reconcile.checked")
    assert checked.result == "not_found_waiting" and checked.levelno == logging.DEBUG
    downstream = store.get("shop", outcome.operation_id).downstream_key
    assert_nothing_secret(caplog.records, KEY, downstream, SECRET_CUSTOMER)


def test_a_forged_webhook_is_a_warning(
    store: Store, sandbox_provider: SandboxProvider, caplog: pytest.LogCaptureFixture
) -> None:
    handler = WebhookHandler(store=store, providers=[sandbox_provider])
    body = json.dumps({"type": "effect.succeeded", "data": {"id": "sbx_1"}}).encode()
    headers = {"webhook-id": "msg_1", "webhook-timestamp": "1", "webhook-signature": "v1,AAAA"}
    with caplog.at_level(logging.INFO, logger="payorch"), pytest.raises(WebhookSignatureInvalid):
        handler.handle("shop", "sandbox", headers, body)
    [rejected] = events(caplog, "webhook.rejected")
    assert rejected.levelno == logging.WARNING and rejected.name == "payorch.webhooks"
    assert rejected.error == "WebhookSignatureInvalid"
    assert_nothing_secret(caplog.records, "sbx_1")  # nothing of the body


def test_nothing_is_built_when_the_level_is_off(caplog: pytest.LogCaptureFixture) -> None:
    class Explodes:
        def __str__(self) -> str:
            raise AssertionError("a field was rendered for a disabled level")

    with caplog.at_level(logging.WARNING, logger="payorch"):
        logs.emit(logs.executor_log, logging.INFO, "x.y", field=Explodes())
    assert not caplog.records


def test_json_and_text_lines(capsys: pytest.CaptureFixture[str]) -> None:
    handler = logs.configure("json", level=logging.INFO)
    try:
        logs.emit(logs.executor_log, logging.INFO, "demo.event", operation_id="op_1", attempt=2)
        logging.getLogger("payorch.executor").info("a plain line")
        logs.configure("text", level=logging.INFO)
        logs.emit(logs.executor_log, logging.WARNING, "demo.event", reason="two words")
    finally:
        logging.getLogger().removeHandler(handler)
        for h in [h for h in logging.getLogger().handlers if h.get_name() == "payorch-cli"]:
            logging.getLogger().removeHandler(h)
        logging.getLogger("payorch").setLevel(logging.NOTSET)
    json_one, json_two, text = capsys.readouterr().err.splitlines()
    line = json.loads(json_one)
    assert line.keys() == {"time", "level", "logger", "event", "operation_id", "attempt"}
    assert (line["level"], line["logger"], line["event"]) == (
        "INFO",
        "payorch.executor",
        "demo.event",
    )
    assert datetime.fromisoformat(line["time"]).utcoffset() == timedelta(0)
    assert json.loads(json_two)["message"] == "a plain line"
    stamp, level, logger, message = text.split(" ", 3)
    assert datetime.fromisoformat(stamp).utcoffset() == timedelta(0)
    assert (level, logger, message) == (
        "WARNING",
        "payorch.executor",
        'demo.event reason="two words"',
    )
    with pytest.raises(ValueError, match="log format"):
        logs.configure("xml")


# -- the CLI ------------------------------------------------------------------------------------


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
    return subprocess.run(
        [str(PAYORCH), *args],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=120,
        check=False,
    )


def test_cli_prints_json_lines(
    db_url: str, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    executor = Executor(
        store=store,
        providers=[sandbox_provider],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
    )
    sandbox.inject(Fault.ERROR_500_AFTER)  # committed there: the reconciler finds it
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key=KEY, request=PAYMENT
    )
    make_due(store, outcome.operation_id)
    env = {"PAYORCH_SANDBOX_URL": sandbox.url}
    proc = run_cli(
        "--log-format", "json", "--log-level", "debug",
        "reconcile", "once", "--database-url", db_url,
        env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "picked 1: succeeded=1"
    lines: list[dict[str, Any]] = [json.loads(x) for x in proc.stderr.splitlines()]
    assert lines and all({"time", "level", "logger"} <= line.keys() for line in lines)
    by_event = {line.get("event"): line for line in lines}
    moved = by_event["operation.transition"]
    assert (moved["from_state"], moved["to_state"]) == ("outcome_unknown", "succeeded")
    assert moved["operation_id"] == outcome.operation_id and moved["level"] == "DEBUG"
    summary = by_event["reconcile.pass"]
    assert summary["picked"] == 1 and summary["outcomes"] == {"succeeded": 1}
    assert summary["level"] == "INFO" and summary["logger"] == "payorch.reconciler"
    downstream = store.get("shop", outcome.operation_id).downstream_key
    assert KEY not in proc.stderr and downstream not in proc.stderr

    text = run_cli("reconcile", "once", "--database-url", db_url, env=env)
    assert text.returncode == 0, text.stderr
    [line] = text.stderr.splitlines()  # the default: text, INFO, the pass only
    assert " INFO payorch.reconciler reconcile.pass picked=0" in line
    bad = run_cli("--log-format", "xml", "stats", "--database-url", db_url, env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ")


# -- progress ------------------------------------------------------------------------------------


def test_progress_is_a_bar_on_a_terminal_and_nothing_in_a_pipe() -> None:
    from rich.console import Console

    from payorch.cli._progress import bar, log_every

    screen = io.StringIO()
    with bar("settling", console=Console(file=screen, force_terminal=True, width=80)) as update:
        update(0, 10)
        update(4, 10)
    assert "settling" in screen.getvalue()
    pipe = io.StringIO()
    with bar("settling", console=Console(file=pipe, force_terminal=False)) as update:
        update(4, 10)
    assert pipe.getvalue() == ""

    seen: list[tuple[int, int]] = []
    every = log_every(100, lambda done, total: seen.append((done, total)))
    for done in range(0, 251):
        every(done, 250)
    assert seen == [(100, 250), (200, 250)]  # the end is the caller's summary line


# -- an application that configured no logging ---------------------------------------------------

# Runs in a fresh interpreter: a payment (INFO lines only), then a forged webhook (a WARNING).
# argv: database URL, sandbox URL, sandbox webhook secret, "configured" or "bare".
_APP = """
import json, logging, sys
from datetime import timedelta
if sys.argv[4] == "configured":
    logging.basicConfig(level=logging.INFO, format="APP %(levelname)s %(name)s %(message)s")
from payorch.errors import WebhookSignatureInvalid
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider
from payorch.reconciling._webhooks import WebhookHandler
from payorch.storage._store import Store

store = Store.from_url(sys.argv[1])
provider = SandboxProvider(base_url=sys.argv[2], webhook_secret=sys.argv[3])
executor = Executor(store=store, providers=[provider], registry=default_registry("sandbox"),
                    lease=timedelta(minutes=2))
outcome = executor.execute(tenant_id="shop", operation="payment.create",
                           idempotency_key="k-" + sys.argv[4],
                           request={"amount": 100, "currency": "EUR"})
print(outcome.state.value)
headers = {"webhook-id": "msg_1", "webhook-timestamp": "1", "webhook-signature": "v1,AAAA"}
try:
    WebhookHandler(store=store, providers=[provider]).handle(
        "shop", "sandbox", headers, json.dumps({"type": "effect.succeeded"}).encode())
except WebhookSignatureInvalid:
    print("refused")
"""


def run_app(db_url: str, sandbox: SandboxServer, mode: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
    args = [db_url, sandbox.url, sandbox.webhook_secret or "", mode]
    return subprocess.run(
        [sys.executable, "-c", _APP, *args],
        capture_output=True,
        text=True,
        env=base,
        timeout=120,
        check=False,
    )


def test_without_logging_configured_warnings_reach_stderr_and_info_stays_quiet(
    db_url: str, sandbox: SandboxServer
) -> None:
    bare = run_app(db_url, sandbox, "bare")
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout.split() == ["succeeded", "refused"]
    # The warning, through Python's last resort (no NullHandler hides it); a payment that
    # went well prints nothing.
    [line] = bare.stderr.splitlines()
    assert line.startswith("webhook.rejected ") and "error=WebhookSignatureInvalid" in line

    configured = run_app(db_url, sandbox, "configured")
    assert configured.returncode == 0, configured.stderr
    lines = configured.stderr.splitlines()
    assert all(x.startswith("APP ") for x in lines), lines  # the app's handler, once each
    rejected = [x for x in lines if "webhook.rejected" in x]
    assert rejected == [x for x in lines if x.startswith("APP WARNING payorch.webhooks")]
    assert len(rejected) == 1
    assert any(x.startswith("APP INFO payorch.executor operation.transition") for x in lines)
