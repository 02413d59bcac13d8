"""``payorch sandbox serve`` as an operator runs it: a real process on loopback, its flags
seen at the provider (the sandbox ledger) and in payorch (the stored operation), its bad
flags refused in one line, and its webhook target settling an unknown payment in a real
FastAPI app (tests/fastapi_server.py). docs/sandbox.md documents what is tested here."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import TracebackType
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from cli_helpers import runner
from conftest import FAST_TIMEOUT, RecordingSleep, make_due
from fastapi_server import UvicornServer, free_port

from payorch.cli._app import app
from payorch.core import State
from payorch.errors import ProviderUnavailable
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider
from payorch.storage._store import Store
from payorch.storage._tables import webhook_inbox

READY_WITHIN = 60.0  # seconds: the interpreter starting and importing the CLI, bounded
STOP_WITHIN = 15.0
BANNER_END = "press Ctrl-C to stop"
SECRET = "whsec_c2FuZGJveC10ZXN0LXNlY3JldC0xMjM0NTY3OA=="
PAYMENT = {"amount": 1999, "currency": "EUR", "customer": "cus_42"}


class Served:
    """``payorch sandbox serve --port 0 FLAGS…`` in a subprocess, ready once its banner is
    printed; its URL is read from the banner's first line."""

    def __init__(self, *flags: str, port: int = 0) -> None:
        self._cmd = [sys.executable, "-m", "payorch.cli", "sandbox", "serve", "--port", str(port)]
        self._cmd += list(flags)
        # The secret comes from the flags or is generated: never from the caller's environment.
        self._env = {k: v for k, v in os.environ.items() if k != "PAYORCH_SANDBOX_WEBHOOK_SECRET"}
        self._proc: subprocess.Popen[str] | None = None
        self.banner: list[str] = []
        self.stderr: list[str] = []
        self._readers: list[threading.Thread] = []
        self.url = ""
        self.returncode: int | None = None

    def __enter__(self) -> Served:
        proc = subprocess.Popen(
            self._cmd,
            env=self._env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._proc = proc
        lines: queue.Queue[str] = queue.Queue()
        assert proc.stdout is not None and proc.stderr is not None
        out, err = proc.stdout, proc.stderr

        def pump() -> None:
            for line in out:
                lines.put(line)

        self._readers = [
            threading.Thread(target=pump, daemon=True),
            threading.Thread(target=lambda: self.stderr.extend(err), daemon=True),
        ]
        for reader in self._readers:
            reader.start()
        deadline = time.monotonic() + READY_WITHIN
        while BANNER_END not in self.banner:  # bounded: the deadline
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.__exit__(None, None, None)
                raise RuntimeError(f"no banner: {self.banner} {self.stderr}") from None
            self.banner.append(line.rstrip("\n"))
        self.url = self.banner[0].removeprefix("sandbox acquirer listening on ")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()  # SIGTERM: serve() stops cleanly and exits 0
        try:
            self.returncode = proc.wait(STOP_WITHIN)
        except subprocess.TimeoutExpired:
            proc.kill()
            self.returncode = proc.wait(STOP_WITHIN)
        for reader in self._readers:
            reader.join(STOP_WITHIN)  # both pipes are at their end: the process is gone
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()

    def get(self, path: str) -> Any:
        response = httpx.get(f"{self.url}{path}", timeout=5.0)
        assert response.status_code == 200, response.text
        return response.json()

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        response = httpx.post(f"{self.url}{path}", json=body or {}, timeout=5.0)
        assert response.status_code == 200, response.text
        return response.json()

    def effects(self, downstream_key: str) -> list[dict[str, Any]]:
        return [e for e in self.get("/v1/ledger")["data"] if e["idempotency_key"] == downstream_key]


# -- bad flags: one line, exit 2, nothing served --------------------------------------------

BAD_FLAGS = {
    "unknown fault kind": (["--fault-rate", "meteor=0.1"], "--fault-rate", "unknown fault"),
    "rate above 1": (["--fault-rate", "timeout=1.5"], "--fault-rate", "within 0..1"),
    "rate not a number": (["--fault-rate", "decline=lots"], "--fault-rate", "within 0..1"),
    "rate without =": (["--fault-rate", "decline"], "--fault-rate", "KIND=RATE"),
    "rates over 1": (
        ["--fault-rate", "decline=0.6", "--fault-rate", "timeout=0.6"],
        "--fault-rate",
        "more than 1",
    ),
    "rate given twice": (
        ["--fault-rate", "decline=0.1", "--fault-rate", "decline=0.2"],
        "--fault-rate",
        "twice",
    ),
    "unknown one-shot fault": (["--fault-next", "meteor"], "--fault-next", "unknown fault"),
    "one-shot count 0": (["--fault-next", "timeout:0"], "--fault-next", "whole number"),
    "one-shot count not a number": (["--fault-next", "timeout:x"], "--fault-next", "whole"),
    # "²".isdigit() is true, int("²") is not: only ASCII digits are a count.
    "one-shot count a superscript": (["--fault-next", "timeout:²"], "--fault-next", "whole"),
    "one-shot count past int's digits": (
        ["--fault-next", "timeout:" + "9" * 5000],
        "--fault-next",
        "whole",
    ),
    "bad duration": (["--latency", "soon"], "--latency", "not a duration"),
    "bad webhook delay": (["--webhook-delay", "-1s"], "--webhook-delay", "not a duration"),
    # Milliseconds beyond what a timedelta holds, and beyond what a wait takes.
    "latency past a timedelta": (
        ["--latency", "99999999999999999999ms"],
        "--latency",
        "at most 1h",
    ),
    "latency past an hour in ms": (["--latency", "9999999999999ms"], "--latency", "at most 1h"),
    "latency past an hour": (["--latency", "2h"], "--latency", "at most 1h"),
    "jitter past an hour": (["--jitter", "61m"], "--jitter", "at most 1h"),
    "drop hold past an hour": (["--drop-hold", "1d"], "--drop-hold", "at most 1h"),
    "webhook delay past a day in ms": (
        ["--webhook-delay", "9999999999999ms"],
        "--webhook-delay",
        "at most 1d",
    ),
    "status lag past 100 years in ms": (
        ["--status-lag", "9999999999999999ms"],
        "--status-lag",
        "at most 100 years",
    ),
    "webhook target port not a number": (
        ["--webhook-url", "http://127.0.0.1:abc/hook"],
        "--webhook-url",
        "host[:port]",
    ),
    "webhook target port out of range": (
        ["--webhook-url", "http://127.0.0.1:99999/hook"],
        "--webhook-url",
        "1..65535",
    ),
    "webhook target not loopback": (
        ["--webhook-url", "http://192.0.2.1/hook"],
        "--webhook-url",
        "loopback",
    ),
    "webhook target other placeholder": (
        ["--webhook-url", "http://127.0.0.1:8000/webhooks/{shop}/sandbox"],
        "--webhook-url",
        "{tenant}",
    ),
    "webhook secret not base64": (
        ["--webhook-secret", "not base64!"],
        "--webhook-secret",
        "base64",
    ),
    "webhook secret empty": (["--webhook-secret", ""], "--webhook-secret", "non-empty"),
    "host not loopback": (["--host", "192.0.2.1"], "--host", "loopback"),
    "port out of range": (["--port", "70000"], "--port", "65535"),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_a_bad_flag_is_one_line_and_exit_2(case: str) -> None:
    flags, names, says = BAD_FLAGS[case]
    unset: dict[str, str | None] = {"PAYORCH_SANDBOX_WEBHOOK_SECRET": None}
    result = runner.invoke(app, ["sandbox", "serve", *flags], env=unset)
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: ") and names in line and says in line, line
    assert "Traceback" not in result.output
    assert result.stdout == ""  # refused before anything listened: no banner


# -- the banner and the control routes ------------------------------------------------------


def test_the_banner_says_what_listens_and_which_faults() -> None:
    flags = ["--fault-rate", "timeout=0.25", "--fault-rate", "decline=0.1"]
    flags += ["--fault-next", "reset_after:2", "--fault-next", "pending"]
    flags += ["--latency", "250ms", "--jitter", "100ms", "--status-lag", "2s"]
    flags += ["--webhook-url", "http://127.0.0.1:9/webhooks/{tenant}/sandbox"]
    flags += ["--webhook-delay", "5s", "--webhook-secret", SECRET]
    with Served(*flags) as sb:
        assert httpx.get(f"{sb.url}/healthz", timeout=5.0).json() == {"ok": True}
        faults = sb.get("/sandbox/faults")
    assert sb.returncode == 0
    assert sb.url.startswith("http://127.0.0.1:")
    assert sb.banner == [
        f"sandbox acquirer listening on {sb.url}",
        f"webhook secret: {SECRET}",
        "webhooks: posted 5s after each event to http://127.0.0.1:9/webhooks/{tenant}/sandbox",
        "fault rates: decline=0.1, drop_after=0.25",  # timeout is drop_after's other name
        "next faults: reset_after x2, pending x1",
        "latency: 250ms + up to 100ms jitter",
        "idempotency window 24h, status lag 2s, settle after 10s, drop hold 30s, "
        "trickle interval 50ms, retry-after 1s",
        BANNER_END,
    ]
    assert faults == {
        "queued": ["reset_after", "reset_after", "pending"],
        "rates": {"decline": 0.1, "drop_after": 0.25},
        "seen": {},
    }


def test_defaults_are_as_before_and_the_secret_comes_from_the_environment() -> None:
    result = runner.invoke(app, ["sandbox", "serve", "--help"])
    assert result.exit_code == 0
    for default in ("8765", "127.0.0.1", "10s", "24h", "30s", "50ms"):
        assert f"[default: {default}]" in result.stdout
    with Served() as sb:
        pass
    assert sb.banner[2:6] == [
        "webhooks: kept, not posted (no --webhook-url)",
        "fault rates: none",
        "next faults: none",
        "latency: none",
    ]
    assert sb.banner[1].startswith("webhook secret: whsec_")


# -- every fault kind at a rate of 1: what the provider did, what payorch stored -------------

# kind -> (the state payorch stores, the statuses of the effects at the ledger)
AT_RATE_ONE: dict[str, tuple[State | None, list[str]]] = {
    "latency": (State.SUCCEEDED, ["succeeded"]),
    "decline": (State.FAILED_FINAL, ["declined"]),
    "error_500_before": (State.OUTCOME_UNKNOWN, []),
    "error_500_after": (State.OUTCOME_UNKNOWN, ["succeeded"]),
    "drop_after": (State.OUTCOME_UNKNOWN, ["succeeded"]),
    "timeout": (State.OUTCOME_UNKNOWN, ["succeeded"]),
    "reset_after": (State.OUTCOME_UNKNOWN, ["succeeded"]),
    "trickle": (State.OUTCOME_UNKNOWN, ["succeeded"]),
    "pending": (State.OUTCOME_UNKNOWN, ["processing"]),
    "rate_limit": (None, []),  # never sent: ProviderUnavailable, released for the same key
}


def _executor(store: Store, url: str) -> tuple[Executor, SandboxProvider]:
    # The deadline bounds a trickled answer; drop_after's hold is 0s so the call ends at once.
    provider = SandboxProvider(base_url=url, timeout=FAST_TIMEOUT, deadline=timedelta(seconds=4))
    executor = Executor(
        store=store,
        providers=[provider],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
        sleep=RecordingSleep(),  # rate_limit's inline retries wait for nothing
    )
    return executor, provider


@pytest.fixture(scope="module")
def at_rate_one() -> Iterator[Callable[[str], Served]]:
    """One server per fault kind, shared by the SQLite and the PostgreSQL run."""
    started: dict[str, Served] = {}

    def served(kind: str) -> Served:
        if kind not in started:
            flags = ["--fault-rate", f"{kind}=1", "--drop-hold", "0s"]
            started[kind] = Served(*flags, "--trickle-interval", "1s").__enter__()
        return started[kind]

    try:
        yield served
    finally:
        for sb in started.values():
            sb.__exit__(None, None, None)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(AT_RATE_ONE))
def test_a_fault_rate_of_one_gives_that_outcome(
    store: Store, at_rate_one: Callable[[str], Served], kind: str
) -> None:
    state, statuses = AT_RATE_ONE[kind]
    sb = at_rate_one(kind)
    fault = "drop_after" if kind == "timeout" else kind
    before = sb.get("/sandbox/faults")["seen"].get(fault, 0)
    executor, provider = _executor(store, sb.url)
    tenant = f"t-{uuid.uuid4().hex[:8]}"

    def pay() -> Any:
        return executor.execute(
            tenant_id=tenant, operation="payment.create", idempotency_key="k-1", request=PAYMENT
        )

    with provider:
        if state is None:
            with pytest.raises(ProviderUnavailable) as refused:
                pay()
            operation_id = refused.value.operation_id
            assert operation_id is not None
        else:
            outcome = pay()
            assert outcome.state is state, outcome
            operation_id = outcome.operation_id
    record = store.get(tenant, operation_id)
    assert [e["status"] for e in sb.effects(record.downstream_key)] == statuses
    seen = sb.get("/sandbox/faults")["seen"]
    assert set(seen) == {fault}  # every POST got the fault, and each attempt was one POST
    assert seen[fault] - before == record.attempts
    if state is None:  # refused before sending, every attempt: nothing stored as final
        assert record.state is State.IN_PROGRESS and record.released and record.attempts > 1
    else:
        assert record.state is state and record.attempts == 1


# -- lag: the status lag hides an effect from payorch's reconciler until it has passed ------


def test_status_lag_then_reconcile_once_settles_and_the_cli_shows_it(
    db_url: str, store: Store
) -> None:
    flags = ["--fault-next", "error_500_after", "--status-lag", "1h"]
    with Served(*flags) as sb:
        executor, provider = _executor(store, sb.url)
        with provider:
            unknown = executor.execute(
                tenant_id="shop-1",
                operation="payment.create",
                idempotency_key="order-1",
                request=PAYMENT,
            )
        assert unknown.state is State.OUTCOME_UNKNOWN
        key = store.get("shop-1", unknown.operation_id).downstream_key
        assert [e["status"] for e in sb.effects(key)] == ["succeeded"]  # made, answer lost
        env = {"PAYORCH_SANDBOX_URL": sb.url, "PAYORCH_DATABASE_URL": db_url}
        make_due(store, unknown.operation_id)
        hidden = runner.invoke(app, ["reconcile", "once"], env=env)
        assert hidden.exit_code == 0, hidden.output
        # The lag hides the effect: "not found" within the grace period is no evidence.
        assert store.get("shop-1", unknown.operation_id).state is State.OUTCOME_UNKNOWN
        sb.post("/sandbox/clock/advance", {"seconds": 3600})  # the lag has passed
        make_due(store, unknown.operation_id)
        settled = runner.invoke(app, ["reconcile", "once"], env=env)
        assert settled.exit_code == 0, settled.output
        record = store.get("shop-1", unknown.operation_id)
        assert record.state is State.SUCCEEDED
        assert [e["status"] for e in sb.effects(key)] == ["succeeded"]  # still one effect
    shown = runner.invoke(app, ["ops", "show", unknown.operation_id, "--tenant", "shop-1"], env=env)
    assert shown.exit_code == 0 and "succeeded" in shown.stdout
    assert record.provider_reference is not None and record.provider_reference in shown.stdout


def test_latency_holds_every_api_request_longer_than_a_read_time_out(store: Store) -> None:
    with Served("--latency", "1h") as sb:
        executor, provider = _executor(store, sb.url)
        with provider:
            outcome = executor.execute(
                tenant_id="shop-1",
                operation="payment.create",
                idempotency_key="order-1",
                request=PAYMENT,
            )
        # The request was sent and never answered: unknown, not "not sent".
        assert outcome.state is State.OUTCOME_UNKNOWN
        assert outcome.error_code == "ReadTimeout"
        assert sb.get("/v1/ledger")["data"] == []  # still waiting: nothing made yet
    assert sb.returncode == 0  # SIGTERM ended the wait: nothing was made


# -- the webhook target: a real FastAPI app takes the signed event and settles --------------


def _inbox(db_url: str, tenant: str) -> list[str]:
    engine = sa.create_engine(db_url)
    try:
        query = sa.select(webhook_inbox.c.result).where(webhook_inbox.c.tenant_id == tenant)
        with engine.connect() as conn:
            return [r.result for r in conn.execute(query)]
    finally:
        engine.dispose()


def _wait_for_webhooks(sb: Served) -> dict[str, Any]:
    deadline = time.monotonic() + 30.0
    while True:  # bounded: the deadline
        stats: dict[str, Any] = sb.get("/sandbox/webhooks")
        if stats["waiting"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)  # a polling interval, not a synchronisation


@pytest.mark.slow
def test_the_webhook_target_settles_an_unknown_payment_in_a_fastapi_app(db_url: str) -> None:
    sandbox_port = free_port()
    env = {
        "PAYORCH_DATABASE_URL": db_url,
        "PAYORCH_SANDBOX_URL": f"http://127.0.0.1:{sandbox_port}",
        "PAYORCH_SANDBOX_WEBHOOK_SECRET": SECRET,
    }
    tenant = f"shop-{uuid.uuid4().hex[:8]}"
    with UvicornServer(env=env) as server:
        target = f"{server.url}/webhooks/{{tenant}}/sandbox"
        # The timeout's answer never comes (closed at once here); its webhook waits an hour,
        # until flushed: the 202 comes first, deterministically.
        flags = ["--fault-next", "timeout", "--drop-hold", "0s", "--webhook-url", target]
        flags += ["--webhook-delay", "1h", "--webhook-secret", SECRET]
        with (
            Served(*flags, port=sandbox_port) as sb,
            httpx.Client(base_url=server.url, timeout=30.0) as client,
        ):
            headers = {"X-Tenant-Id": tenant, "Idempotency-Key": '"order-1"'}
            unknown = client.post("/payments", json=PAYMENT, headers=headers)
            assert unknown.status_code == 202, unknown.text
            assert unknown.json()["state"] == "outcome_unknown"
            location = unknown.headers["Location"]
            polled = client.get(location, headers={"X-Tenant-Id": tenant})
            assert polled.json()["state"] == "outcome_unknown"
            ledger = [
                e
                for e in sb.get("/v1/ledger")["data"]
                if e["metadata"].get("payorch_tenant_id") == tenant
            ]
            assert [e["status"] for e in ledger] == ["succeeded"]
            assert sb.get("/sandbox/webhooks")["waiting"] == 1

            assert sb.post("/sandbox/webhooks/flush") == {"flushed": 1}
            stats = _wait_for_webhooks(sb)
            assert (stats["sent"], stats["failed"], stats["waiting"]) == (1, 0, 0)
            settled = client.get(location, headers={"X-Tenant-Id": tenant})
            assert settled.json()["state"] == "succeeded"
            assert settled.json()["provider_reference"] == ledger[0]["id"]
            replay = client.post("/payments", json=PAYMENT, headers=headers)
            assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
            after = [
                e
                for e in sb.get("/v1/ledger")["data"]
                if e["metadata"].get("payorch_tenant_id") == tenant
            ]
    assert len(after) == 1  # one effect, whatever was retried and notified
    assert _inbox(db_url, tenant) == ["applied"]
