"""Metrics, as an SRE sees them: the daemon as a process, scraped over loopback.

Counters are per process: what the executor did is read from this process's registry (it
runs here), what the reconciler did from the daemon's ``/metrics``; both must equal what
the store recorded. The scrape-time gauges must match ``payorch stats --json``, and
``/readyz`` must turn 503 (with ``/metrics`` still answering) once the database is gone.
"""

from __future__ import annotations

import asyncio
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from conftest import FAST_TIMEOUT, RecordingSleep, create_pg_database
from prometheus_client.parser import text_string_to_metric_families

from payorch import migrate
from payorch.core import State
from payorch.errors import ConfigurationError, IdempotencyKeyReused, WebhookSignatureInvalid
from payorch.execution._async import AsyncExecutor
from payorch.execution._executor import Executor
from payorch.observing import _metrics as metrics
from payorch.operations import default_registry
from payorch.provider import Answer, AnswerKind, StatusQuery, SubmitRequest, WebhookEvent
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.providers.sandbox._faults import Fault
from payorch.reconciling._daemon import ReconcilerDaemon, parse_address
from payorch.reconciling._reconciler import Reconciler
from payorch.reconciling._webhooks import WebhookHandler
from payorch.storage._async_store import AsyncStore
from payorch.storage._store import Store
from payorch.storage._tables import events, operations

PAYORCH = Path(sys.executable).parent / "payorch"
PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}
# One fault (or none) per operation, in order: 3 plain successes, a decline, a 429 retried
# inline, two 500s after the sandbox committed (unknown; the status query finds them) and
# two 500s before it did (unknown; "not found" within the grace period: with max_checks=1
# the first check escalates them to needs_attention).
PLAN: list[Fault | None] = [
    None,
    None,
    None,
    Fault.DECLINE,
    Fault.RATE_LIMIT,
    Fault.ERROR_500_AFTER,
    Fault.ERROR_500_AFTER,
    Fault.ERROR_500_BEFORE,
    Fault.ERROR_500_BEFORE,
]
RECONCILER_KINDS = ("status_query", "abandoned", "check_error", "resubmit")


@pytest.fixture
def own_pg(pg_server_url: str) -> str:
    """A database of its own: the test drops it at the end to take the daemon's away."""
    url = create_pg_database(pg_server_url, "payorch_metrics")
    migrate.upgrade(url)
    return url


def local_value(name: str, **labels: str) -> float:
    assert metrics.registry is not None
    return metrics.registry.get_sample_value(name, labels) or 0.0


def scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    answer = client.get("/metrics")
    assert answer.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(answer.text):
        for s in family.samples:
            samples[s.name, tuple(sorted(s.labels.items()))] = s.value
    return samples


def total(samples: dict[Any, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        v for (n, lbls), v in samples.items() if n == name and labels.items() <= dict(lbls).items()
    )


@dataclass
class Daemon:
    proc: subprocess.Popen[str]
    lines: queue.Queue[str]
    url: str

    def next_line(self) -> str:
        """Block until the daemon logs another line (it logs one per pass that did work)."""
        return self.lines.get(timeout=60)


@pytest.fixture
def daemon(own_pg: str, sandbox: SandboxServer) -> Iterator[Daemon]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
    env.update(
        PAYORCH_DATABASE_URL=own_pg,
        PAYORCH_SANDBOX_URL=sandbox.url,
        PAYORCH_SANDBOX_WEBHOOK_SECRET=sandbox.webhook_secret,
        PAYORCH_METRICS_ADDR="127.0.0.1:0",  # the daemon says which port it took
        PAYORCH_NOT_FOUND_GRACE_SECONDS="3600",
        PAYORCH_MAX_CHECKS="1",
    )
    argv = [str(PAYORCH), "reconcile", "run", "--interval", "0.2"]
    proc = subprocess.Popen(
        argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    lines: queue.Queue[str] = queue.Queue()

    def drain() -> None:  # keeps the pipe from filling up while the daemon runs
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        url = ""
        while not url:
            line = lines.get(timeout=60)
            if "monitor.started" in line:
                url = line.split("url=", 1)[1].split()[0].strip('"')
        yield Daemon(proc=proc, lines=lines, url=url)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=30)  # EOF once the process is gone
        assert proc.stderr is not None
        proc.stderr.close()


def run_operations(store: Store, sandbox: SandboxServer) -> None:
    with SandboxProvider(
        base_url=sandbox.url, webhook_secret=sandbox.webhook_secret, timeout=FAST_TIMEOUT
    ) as provider:
        executor = Executor(
            store=store,
            providers=[provider],
            registry=default_registry("sandbox"),
            lease=timedelta(seconds=30),
            sleep=RecordingSleep(),
        )
        for i, fault in enumerate(PLAN):
            if fault is not None:
                sandbox.inject(fault)
            executor.execute(
                tenant_id="shop",
                operation="payment.create",
                idempotency_key=f"k{i}",
                request=PAYMENT,
            )
        assert executor.execute(
            tenant_id="shop", operation="payment.create", idempotency_key="k0", request=PAYMENT
        ).replayed
        with pytest.raises(IdempotencyKeyReused):
            executor.execute(
                tenant_id="shop",
                operation="payment.create",
                idempotency_key="k0",
                request={**PAYMENT, "amount": 1},
            )


def count(store: Store, query: sa.Select[Any]) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def answers_by_state(store: Store) -> dict[str, int]:
    e = events.c
    query = (
        sa.select(e.to_state, sa.func.count())
        .where(e.kind == "provider_answer")
        .group_by(e.to_state)
    )
    out: dict[str, int] = {}
    with store.engine.connect() as conn:
        for state, n in conn.execute(query).all():
            out[str(state)] = int(n)
        # An uneventful answer's event is kept on its operation's row (answer_event).
        t = operations.c
        for state, kept in conn.execute(sa.select(t.state, t.answer_event)).all():
            if kept is not None and kept["kind"] == "provider_answer":
                out[str(state)] = out.get(str(state), 0) + 1
    return out


@pytest.mark.slow
@pytest.mark.postgres
def test_executor_counters_equal_the_store(own_pg: str, sandbox: SandboxServer) -> None:
    labels = {"operation": "payment.create", "provider": "sandbox"}
    names = (
        [("payorch_executions_total", {**labels, "result": r}) for r in ("fresh", "replayed")]
        + [("payorch_execution_outcomes_total", {**labels, "state": s.value}) for s in State]
        + [
            ("payorch_execution_refusals_total", {**labels, "reason": "idempotency_key_reused"}),
            ("payorch_inline_retries_total", {"provider": "sandbox"}),
        ]
    )
    before = {(n, tuple(lbls.items())): local_value(n, **lbls) for n, lbls in names}
    store = Store.from_url(own_pg)
    try:
        run_operations(store, sandbox)
        delta = {(n, lbls): local_value(n, **dict(lbls)) - before[n, lbls] for n, lbls in before}

        def d(name: str, **extra: str) -> float:
            return delta[name, tuple({**labels, **extra}.items())]

        e, t = events.c, operations.c
        assert d("payorch_executions_total", result="fresh") == len(PLAN)
        assert count(store, sa.select(sa.func.count()).select_from(operations)) == len(PLAN)
        replays = count(store, sa.select(sa.func.sum(t.replays)))
        assert d("payorch_executions_total", result="replayed") == replays == 1
        reused = sa.select(sa.func.count()).where(e.kind == "key_reused")
        assert d("payorch_execution_refusals_total", reason="idempotency_key_reused") == count(
            store, reused
        )
        by_state = answers_by_state(store)
        for state in State:
            assert d("payorch_execution_outcomes_total", state=state.value) == by_state.get(
                state.value, 0
            ), state
        assert by_state[State.OUTCOME_UNKNOWN.value] == 4  # the unknowns are counted
        attempts = count(store, sa.select(sa.func.count()).where(e.kind == "attempt"))
        assert delta["payorch_inline_retries_total", (("provider", "sandbox"),)] == attempts == 1
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.postgres
def test_daemon_counters_gauges_and_probes(
    own_pg: str, pg_server_url: str, sandbox: SandboxServer, daemon: Daemon
) -> None:
    store = Store.from_url(own_pg)
    try:
        run_operations(store, sandbox)
        flagged = (
            sa.select(sa.func.count()).select_from(operations).where(operations.c.needs_attention)
        )
        e = events.c
        checks = sa.select(sa.func.count()).where(
            e.actor.like("reconciler:%"), e.kind.in_(RECONCILER_KINDS)
        )
        with httpx.Client(base_url=daemon.url, timeout=10) as client:
            assert client.get("/healthz").status_code == 200
            # Wait (woken by the daemon's own log lines, bounded) until the four unknowns
            # were checked: two settled by the status query, two escalated.
            for _ in range(200):
                samples = scrape(client)
                done = total(samples, "payorch_reconciler_checks_total", result="succeeded")
                waiting = total(samples, "payorch_escalations_total", reason="max_checks")
                if done >= 2 and waiting >= 2:
                    break
                daemon.next_line()
            else:
                pytest.fail("the daemon never checked the unknown operations")
            # Counters against the store, at a quiet moment (nothing changed between two
            # scrapes around the read): every check wrote one event, every escalation a flag.
            for _ in range(50):
                first = scrape(client)
                stored = (count(store, checks), count(store, flagged))
                second = scrape(client)
                seen = [
                    (
                        total(s, "payorch_reconciler_checks_total"),
                        total(s, "payorch_escalations_total"),
                    )
                    for s in (first, second)
                ]
                if seen[0] == seen[1] == stored:
                    break
            else:
                pytest.fail(f"counters never matched the store: {seen} vs {stored}")
            assert stored[1] == 2
            assert total(first, "payorch_reconciler_checks_total", result="succeeded") == 2
            assert total(first, "payorch_reconciler_passes_total", result="ok") >= 1

            # Gauges against `payorch stats --json` (both read the database now).
            before = time.monotonic()
            gauges = scrape(client)
            stats = stats_json(own_pg)
            elapsed = time.monotonic() - before
            assert gauges["payorch_database_up", ()] == 1
            for state in (State.IN_PROGRESS, State.OUTCOME_UNKNOWN):
                key = ("payorch_operations", (("state", state.value),))
                assert gauges[key] == stats["by_state"][state.value]
            assert stats["by_state"][State.OUTCOME_UNKNOWN.value] == 2
            assert gauges["payorch_needs_attention_operations", ()] == stats["needs_attention"] == 2
            age = gauges["payorch_oldest_unknown_age_seconds", ()]
            assert abs(age - stats["oldest_unknown_age_seconds"]) <= elapsed + 0.01
            assert 0 <= gauges["payorch_due_operations", ()] <= 2
            assert client.get("/readyz").status_code == 200

            # The database goes away: ready no more, the scrape still answers.
            drop_database(pg_server_url, own_pg, store)
            ready = client.get("/readyz")
            assert ready.status_code == 503 and "database unreachable" in ready.text
            gone = scrape(client)
            assert gone["payorch_database_up", ()] == 0
            assert ("payorch_operations", (("state", "outcome_unknown"),)) not in gone
            assert client.get("/healthz").status_code == 200
        assert daemon.proc.poll() is None  # still running: the next pass retries
    finally:
        store.close()


def stats_json(url: str) -> dict[str, Any]:
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
    done = subprocess.run(
        [str(PAYORCH), "stats", "--json", "--database-url", url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def drop_database(server_url: str, url: str, store: Store) -> None:
    store.engine.dispose()
    name = sa.make_url(url).database
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


BLOCKED = """
import sys, json, urllib.request, urllib.error
from datetime import timedelta

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "prometheus_client":
            raise ImportError("blocked for this test")

sys.meta_path.insert(0, Block())
from payorch import metrics, migrate
from payorch import Executor, Reconciler, ReconcilerDaemon, Store
from payorch.operations import default_registry
from payorch.provider import Answer, AnswerKind

class Instant:
    name = "instant"
    idempotency_window = timedelta(hours=24)
    max_call_duration = timedelta(milliseconds=10)
    def submit(self, request):
        return Answer(kind=AnswerKind.SUCCEEDED, provider_reference="ref_1")
    def query_status(self, query):
        return Answer(kind=AnswerKind.SUCCEEDED, provider_reference="ref_1")
    def parse_webhook(self, headers, body):
        raise NotImplementedError

url = sys.argv[1]
migrate.upgrade(url)
store = Store.from_url(url)
ex = Executor(store=store, providers=[Instant()], registry=default_registry("instant"))
out = ex.execute(tenant_id="t", operation="payment.create", idempotency_key="k",
                 request={"amount": 5, "currency": "EUR", "customer": "c"})
rec = Reconciler(store=store, providers=[Instant()])
rec.reconcile_once()
daemon = ReconcilerDaemon(rec, monitor=("127.0.0.1", 0))
daemon.start()
base = daemon.monitor.url
codes = {}
for path in ("/metrics", "/healthz", "/readyz"):
    try:
        codes[path] = urllib.request.urlopen(base + path, timeout=10).status
    except urllib.error.HTTPError as exc:
        codes[path] = exc.code
daemon.stop()
store.close()

async def scrape():  # the ASGI app of a service: says what is missing, like the daemon
    sent = []
    async def receive():
        return {"type": "http.request", "body": b""}
    async def send(message):
        sent.append(message)
    app = metrics.asgi_app(store=store)
    await app({"type": "http", "method": "GET", "path": "/metrics", "headers": []}, receive, send)
    return sent[0]["status"], sent[1]["body"].decode()

import asyncio
codes["asgi"], asgi_body = asyncio.run(scrape())
print(json.dumps({"available": metrics.AVAILABLE, "registry": metrics.registry is None,
                  "state": out.state.value, "codes": codes, "asgi": asgi_body,
                  "loaded": "prometheus_client" in sys.modules}))
"""


@pytest.mark.slow
def test_without_prometheus_client_everything_is_a_no_op(tmp_path: Path) -> None:
    import json

    done = subprocess.run(
        [sys.executable, "-c", BLOCKED, f"sqlite:///{tmp_path / 'p.db'}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "available": False,
        "registry": True,
        "state": "succeeded",
        # /metrics says what is missing; the probes work without the extra.
        "codes": {"/metrics": 404, "/healthz": 200, "/readyz": 200, "asgi": 404},
        "asgi": "metrics need the payorch[metrics] extra\n",
        "loaded": False,
    }


# -- smaller pieces ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("[::1]:0", ("::1", 0)),
        ("localhost:80", ("localhost", 80)),
        ("off", None),
        (" OFF ", None),
    ],
)
def test_metrics_address_parses(text: str, parsed: tuple[str, int] | None) -> None:
    assert parse_address(text) == parsed


@pytest.mark.parametrize("text", ["9464", ":9464", "host:", "h:99999", "::1:9464", "[x]:1", "h:-1"])
def test_a_bad_metrics_address_is_one_line_exit_1(text: str) -> None:
    with pytest.raises(ConfigurationError, match="not host:port"):
        parse_address(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
    env["PAYORCH_METRICS_ADDR"] = text
    done = subprocess.run(
        [str(PAYORCH), "reconcile", "run"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: metrics address")


def test_a_taken_port_stops_the_daemon_before_any_pass(store: Store) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        reconciler = Reconciler(store=store, providers=[])
        daemon = ReconcilerDaemon(reconciler, monitor=("127.0.0.1", port))
        with pytest.raises(ConfigurationError, match=r"cannot serve metrics on .*in use"):
            daemon.start()
        assert daemon.passes == 0 and daemon.monitor is None


def test_webhooks_are_counted_by_status(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    executor = Executor(
        store=store,
        providers=[sandbox_provider],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
    )
    sandbox.inject(Fault.DROP_AFTER)  # unknown; the sandbox sends the webhook that settles it
    executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key="w1", request=PAYMENT
    )
    (delivery,) = sandbox.webhook_deliveries()
    handler = WebhookHandler(store=store, providers=[sandbox_provider])
    statuses = ("applied", "duplicate", "rejected")
    before = {
        s: local_value("payorch_webhooks_total", provider="sandbox", status=s) for s in statuses
    }
    results = [handler.handle("shop", "sandbox", delivery.headers, delivery.body) for _ in range(3)]
    with pytest.raises(WebhookSignatureInvalid):
        handler.handle(
            "shop", "sandbox", {**delivery.headers, "webhook-signature": "v1,AAAA"}, delivery.body
        )
    after = {
        s: local_value("payorch_webhooks_total", provider="sandbox", status=s) for s in statuses
    }
    assert [str(r.status) for r in results] == ["applied", "duplicate", "duplicate"]
    assert {s: after[s] - before[s] for s in statuses} == {
        "applied": 1,
        "duplicate": 2,
        "rejected": 1,
    }


class AsyncInstant:
    name = "instant"
    idempotency_window = timedelta(hours=24)
    max_call_duration = timedelta(milliseconds=10)

    async def asubmit(self, request: SubmitRequest) -> Answer:
        return Answer(kind=AnswerKind.SUCCEEDED, provider_reference=f"ref_{request.operation_id}")

    async def aquery_status(self, query: StatusQuery) -> Answer:
        return Answer(kind=AnswerKind.SUCCEEDED, provider_reference=f"ref_{query.operation_id}")

    def parse_webhook(self, headers: Mapping[str, str], body: bytes) -> WebhookEvent:
        raise NotImplementedError


def test_the_async_executor_counts_once_per_call(db_url: str, loop_thread: Any) -> None:
    labels = {"operation": "payment.create", "provider": "instant"}

    def counts() -> tuple[float, ...]:
        return (
            local_value("payorch_executions_total", **labels, result="fresh"),
            local_value("payorch_executions_total", **labels, result="replayed"),
            local_value(
                "payorch_provider_answers_total",
                provider="instant",
                call="submit",
                kind="succeeded",
            ),
        )

    async def twice() -> None:
        store = AsyncStore.from_url(db_url)
        try:
            executor = AsyncExecutor(
                store=store, providers=[AsyncInstant()], registry=default_registry("instant")
            )
            for _ in range(2):
                await executor.execute(
                    tenant_id="t", operation="payment.create", idempotency_key="a1", request=PAYMENT
                )
        finally:
            await store.close()

    before = counts()
    loop_thread.run(twice())
    assert [a - b for a, b in zip(counts(), before, strict=True)] == [1, 1, 1]


def test_watch_takes_a_sync_or_an_async_store_and_refuses_anything_else(db_url: str) -> None:
    from payorch import AsyncStore, Store
    from payorch import metrics as public

    store, async_store = Store.from_url(db_url), AsyncStore.from_url(db_url)
    before = public.registry.get_sample_value("payorch_database_up")
    try:
        with pytest.raises(ConfigurationError, match="needs a Store or an AsyncStore, not str"):
            public.watch(db_url)  # type: ignore[arg-type]
        # Refused before anything was registered: the earlier gauges (if any) still stand.
        assert public.registry.get_sample_value("payorch_database_up") == before
        gauges = public.watch(async_store)
        assert gauges is not None and gauges.is_async
        # An async store is read by refresh() (on its loop), not by a synchronous collect.
        assert public.registry.get_sample_value("payorch_database_up") == 0.0
        asyncio.run(public.refresh())
        assert public.registry.get_sample_value("payorch_database_up") == 1.0
        assert public.watch(store) is not None
        assert public.registry.get_sample_value("payorch_database_up") == 1.0
    finally:
        for gauges in list(metrics._watched):
            public.registry.unregister(gauges)
        metrics._watched.clear()
        store.close()
        asyncio.run(async_store.close())
