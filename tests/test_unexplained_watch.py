"""The reconciler daemon's scheduled look for unexplained effects, and how it is configured."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from unexplained_helpers import TENANT, lose, make_executor, namespace_ops, pay

from payorch.cli._reconcile import unexplained_watch
from payorch.core import State
from payorch.errors import UnknownProvider
from payorch.execution._executor import Executor
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._daemon import ReconcilerDaemon
from payorch.reconciling._reconciler import Reconciler
from payorch.reconciling._watch import UnexplainedWatch
from payorch.settings import Settings
from payorch.storage._store import Store

# The installation's key scope is the environment's: none unless a test sets one.
pytestmark = pytest.mark.usefixtures("no_key_scope")


@pytest.fixture
def executor(store: Store, sandbox_provider: SandboxProvider) -> Executor:
    return make_executor(store, sandbox_provider)


# -- the daemon's scheduled look -----------------------------------------------------------


def test_the_daemon_adopts_on_its_schedule_when_asked(
    store: Store, executor: Executor, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    lost = pay(executor, "k-daemon")
    lose(store, lost.operation_id)
    rec = Reconciler(store=store, providers=[sandbox_provider], owner="reconciler:test")
    config = Settings(unexplained_every_seconds=0.2, unexplained_adopt=True)
    watch = unexplained_watch(rec, config)
    assert isinstance(watch, UnexplainedWatch)
    daemon = ReconcilerDaemon(rec, interval=timedelta(seconds=30), unexplained=watch)
    daemon.start()
    try:
        deadline = datetime.now(UTC) + timedelta(seconds=20)
        while not namespace_ops(store, "k-daemon") and datetime.now(UTC) < deadline:
            threading.Event().wait(0.05)
    finally:
        daemon.stop()
    (adopted,) = namespace_ops(store, "k-daemon")
    assert adopted.needs_attention and adopted.state is State.SUCCEEDED
    assert [(e.kind, e.actor) for e in store.events(TENANT, adopted.id)] == [
        ("adopted", "reconciler:test")
    ]


def test_the_daemon_look_judges_under_the_installation_key_scope(
    store: Store, sandbox_provider: SandboxProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = pay(make_executor(store, sandbox_provider, key_scope="eu-1"), "k-look")
    lose(store, mine.operation_id)
    lose(store, pay(make_executor(store, sandbox_provider, key_scope=""), "k-look").operation_id)
    monkeypatch.setenv("PAYORCH_KEY_SCOPE", "eu-1")  # as the daemon's process has it
    rec = Reconciler(store=store, providers=[sandbox_provider], owner="reconciler:test")
    watch = unexplained_watch(rec, Settings(unexplained_every_seconds=60, unexplained_adopt=True))
    assert watch is not None and watch.key_scope == "eu-1"

    (report,) = watch.run()

    assert report.counts()["other_scope"] == 1 and report.counts()["adopted"] == 1
    (adopted,) = namespace_ops(store, "k-look")
    assert adopted.provider_reference == mine.provider_reference and adopted.needs_attention


def test_the_daemon_look_is_off_by_default_and_checks_its_providers(
    store: Store, sandbox_provider: SandboxProvider
) -> None:
    rec = Reconciler(store=store, providers=[sandbox_provider])
    assert unexplained_watch(rec, Settings()) is None
    listing_only = unexplained_watch(rec, Settings(unexplained_every_seconds=60))
    assert listing_only is not None and not listing_only.adopt
    assert [p.name for p in listing_only.providers] == ["sandbox"]
    with pytest.raises(UnknownProvider, match="stripe"):
        unexplained_watch(
            rec, Settings(unexplained_every_seconds=60, unexplained_providers="sandbox,stripe")
        )
