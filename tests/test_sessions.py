"""The sessions payorch uses: a read-write primary, the caller's engine left as found, the
replication report and the strict setting on a server without a standby.

The failover cases (a real standby, promotion, a cancelled synchronous wait) are in
``test_replication.py``; these need only the suite's PostgreSQL, or none.
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from test_replication import payorch as cli
from typer.testing import CliRunner

from payorch.cli._app import app
from payorch.errors import (
    CommitUncertain,
    ConfigurationError,
    DatabaseReadOnly,
    StorageError,
)
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.storage import _engine as db
from payorch.storage import _sessions as sessions
from payorch.storage._driver_sql import run_sql
from payorch.storage._engine import create_engine
from payorch.storage._replication import Status, num_sync, strict_from_env
from payorch.storage._store import Store

PAYMENT = {"amount": 1500, "currency": "EUR", "customer": "cus_1"}
runner = CliRunner()


def strict_store(url: str) -> Store:
    """A store that claims only while a synchronous standby streams."""
    return Store(create_engine(url), require_sync_standby=True)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


def read_only_url(pg_url: str) -> str:
    url = sa.make_url(pg_url)
    return url.update_query_dict(
        {"options": "-c default_transaction_read_only=on"}
    ).render_as_string(hide_password=False)


# -- a read-only session is a configuration error, at once -------------------------------


def test_a_read_only_session_is_refused_in_one_line_and_nothing_is_sent(
    postgres_url: str, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    store = Store.from_url(read_only_url(postgres_url))
    try:
        executor = Executor(
            store=store, providers=[sandbox_provider], registry=default_registry("sandbox")
        )
        with pytest.raises(DatabaseReadOnly, match="read-only") as caught:
            executor.execute(
                tenant_id="t", operation="payment.create", idempotency_key="k1", request=PAYMENT
            )
        # A configuration error, and a 503 that says "same key": nothing was committed.
        assert isinstance(caught.value, ConfigurationError)
        assert isinstance(caught.value, StorageError) and caught.value.http_status == 503
        assert "\n" not in caught.value.message
        with pytest.raises(DatabaseReadOnly):  # reads too: never a silent stale answer
            store.get("t", "01a00000-0000-7000-8000-000000000000")
    finally:
        store.close()
    assert sandbox.ledger() == []
    assert "read-only" in one_line_error(
        cli("db", "health", "--database-url", read_only_url(postgres_url))
    )


def test_sqlstate_25006_maps_to_the_read_only_error_not_a_retry(postgres_url: str) -> None:
    engine = db.create_engine(postgres_url, pool_size=1, max_overflow=0)
    try:
        run_sql(engine, "SELECT 1", {}, write=False)  # the session is checked and adopted
        with engine.connect() as conn:  # then it turns read-only behind payorch's back
            conn.exec_driver_sql("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
            conn.commit()
        with pytest.raises(DatabaseReadOnly, match="read-only transaction"):
            run_sql(engine, "CREATE TABLE payorch_never (a int)", {})
        with pytest.raises(DatabaseReadOnly):  # the SQLAlchemy path maps it alike
            db.run_in_transaction(engine, lambda c: c.exec_driver_sql("CREATE TABLE nv (a int)"))
    finally:
        engine.dispose()


# -- the caller's engine as it was -------------------------------------------------------


@pytest.mark.parametrize("built_by", ["sqlalchemy", "payorch"])
def test_an_autocommit_engine_stays_in_autocommit_after_payorch_ran_on_it(
    postgres_url: str, built_by: str
) -> None:
    make = sa.create_engine if built_by == "sqlalchemy" else db.create_engine
    engine = make(postgres_url, isolation_level="AUTOCOMMIT", pool_size=1, max_overflow=0)
    table = f"app_rows_{built_by}"
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f"CREATE TABLE IF NOT EXISTS {table} (a int)")
            conn.exec_driver_sql(f"TRUNCATE {table}")
        run_sql(engine, "SELECT 1", {}, write=False)  # payorch's hot path, same connection
        with engine.connect() as conn:  # the app's next write: autocommit, no COMMIT of its own
            conn.exec_driver_sql(f"INSERT INTO {table} VALUES (1)")
        with engine.connect() as conn:
            assert conn.connection.driver_connection.autocommit is True  # type: ignore[union-attr]
        other = sa.create_engine(postgres_url, poolclass=sa.NullPool)
        with other.connect() as conn:
            assert conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar() == 1
        other.dispose()
    finally:
        with engine.connect() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        engine.dispose()


def test_a_transactional_engine_gets_its_transactions_back(postgres_url: str) -> None:
    engine = sa.create_engine(postgres_url, pool_size=1, max_overflow=0)
    try:
        run_sql(engine, "SELECT 1", {}, write=False)
        with engine.connect() as conn:
            assert conn.connection.driver_connection.autocommit is False  # type: ignore[union-attr]
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "build",
    [
        lambda url: sa.create_engine(url, isolation_level="AUTOCOMMIT"),
        lambda url: db.create_engine(url, isolation_level="AUTOCOMMIT"),
        lambda url: sa.create_engine(url).execution_options(isolation_level="AUTOCOMMIT"),
    ],
    ids=["create_engine", "payorch-create_engine", "execution_options"],
)
def test_an_engine_without_atomic_transactions_is_refused_by_the_store(
    db_url: str, build: Any
) -> None:
    engine = build(db_url)
    try:
        with pytest.raises(ConfigurationError, match=r"AUTOCOMMIT.*not be atomic"):
            Store(engine)
        # Given its transactions back, the same engine is accepted.
        level = "SERIALIZABLE" if engine.dialect.name == "sqlite" else "READ COMMITTED"
        Store(engine.execution_options(isolation_level=level))
    finally:
        engine.dispose()


# -- the replication report and the strict setting, without a standby --------------------


def test_health_reports_no_replication_and_the_strict_setting_refuses_at_start_up(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    done = cli("db", "health", "--json", "--database-url", postgres_url)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["mode"] == "none" and report["synchronous"] is False
    assert report["synchronous_standby_names"] == "" and report["standbys_streaming"] == 0
    assert (report["strict"], report["problem"]) == (False, None)
    text = cli("db", "health", "--database-url", postgres_url)
    assert text.returncode == 0 and "replication none:" in text.stdout

    with pytest.raises(ConfigurationError, match="synchronous_standby_names is empty"):
        strict_store(postgres_url)
    strict = {"PAYORCH_REQUIRE_SYNC_STANDBY": "1"}
    refused = one_line_error(cli("db", "health", "--database-url", postgres_url, env=strict))
    assert "PAYORCH_REQUIRE_SYNC_STANDBY is set" in refused and "is empty" in refused
    daemon = cli(
        "reconcile", "run", "--metrics-addr", "off", "--database-url", postgres_url, env=strict
    )
    assert "synchronous_standby_names is empty" in one_line_error(daemon)

    # Not strict: the store starts, and the start-up line says what "none" means (no
    # standby: no failover can lose a commit), at INFO: nothing is at risk.
    store = Store.from_url(postgres_url)
    try:
        with caplog.at_level(logging.INFO, logger="payorch.db"):
            assert store.replication.check().mode == "none"
        [line] = [r for r in caplog.records if getattr(r, "event", "") == "database.replication"]
        assert line.levelno == logging.INFO and line.getMessage().startswith(
            "database.replication mode=none"
        )
        assert "no failover can lose a commit" in line.getMessage()
    finally:
        store.close()


def test_the_strict_setting_on_sqlite_and_bad_values_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'p.db'}"
    with pytest.raises(ConfigurationError, match="SQLite has no standby"):
        strict_store(url)
    monkeypatch.setenv("PAYORCH_REQUIRE_SYNC_STANDBY", "maybe")
    with pytest.raises(ConfigurationError, match="PAYORCH_REQUIRE_SYNC_STANDBY='maybe'"):
        Store.from_url(url)
    for value, strict in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv("PAYORCH_REQUIRE_SYNC_STANDBY", value)
        assert strict_from_env() is strict


def test_sqlite_health_is_local(tmp_path: Path) -> None:
    from payorch import migrate

    url = f"sqlite:///{tmp_path / 'p.db'}"
    migrate.upgrade(url)
    done = runner.invoke(app, ["db", "health", "--json", "--database-url", url])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["mode"] == "local"


def test_the_gauges_carry_the_replication_mode(postgres_url: str) -> None:
    from payorch.observing import _metrics as metrics

    if not metrics.AVAILABLE:
        pytest.skip("prometheus_client is not installed")
    store = Store.from_url(postgres_url)
    try:
        families = {f.name: f for f in metrics.StoreGauges(store).collect()}
    finally:
        store.close()
    modes = {
        s.labels["mode"]: s.value for s in families["payorch_database_replication_mode"].samples
    }
    assert modes["none"] == 1.0 and sum(modes.values()) == 1.0
    assert families["payorch_database_standbys"].samples[0].value == 0


# -- pure pieces -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "count"),
    [("", 0), ("  ", 0), ("*", 1), ("a, b", 1), ("FIRST 2 (a, b, c)", 2), ("any 3 (*)", 3)],
)
def test_how_many_synchronous_standbys_a_setting_waits_for(names: str, count: int) -> None:
    assert num_sync(names) == count


@pytest.mark.parametrize(
    ("row", "mode"),
    [
        ((False, "off", "", "on", 0, 0, 0, "C"), "none"),
        ((False, "off", "", "on", 1, 0, 0, "C"), "async"),
        ((False, "off", "s1", "local", 1, 1, 0, "C"), "async"),  # commits do not wait
        ((False, "off", "s1", "on", 1, 1, 0, "C"), "sync"),
        ((False, "off", "ANY 2 (s1, s2)", "on", 2, 1, 0, "C"), "sync_blocked"),
        ((False, "off", "s1", "remote_apply", 0, 0, 0, "C"), "sync_blocked"),
        ((False, "off", "s1", "on", 0, 0, 1, "C"), "unknown"),  # rows hidden from the role
        ((True, "on", "", "on", 0, 0, 0, "C"), "read_only"),
    ],
)
def test_the_mode_follows_settings_and_streaming_standbys(row: tuple[Any, ...], mode: str) -> None:
    status = Status.from_row(row)
    assert status.mode == mode
    assert (status.refusal() is None) is (mode == "sync")


def test_only_the_cancelled_sync_wait_warning_is_remembered() -> None:
    watch = sessions.Watch()

    def notice(severity: str, message: str) -> SimpleNamespace:
        return SimpleNamespace(severity_nonlocalized=severity, message_primary=message)

    watch(notice("WARNING", "NOTIFY queue is 60% full"))
    watch(notice("NOTICE", "relation exists, skipping"))
    assert watch.seen is None
    watch(notice("WARNING", "canceling wait for synchronous replication due to user request"))
    assert watch.seen is not None
    err = sessions.wait_cancelled(watch.seen)
    assert isinstance(err, CommitUncertain) and "retry with the same key" in err.message


def test_a_multi_host_url_becomes_one_libpq_conninfo() -> None:
    engine = sa.create_engine(
        "postgresql+psycopg://app:s3cret@/pay?host=10.0.0.1:5433&host=10.0.0.2:5434"
        "&target_session_attrs=read-write"
    )
    from psycopg.conninfo import conninfo_to_dict

    parsed = conninfo_to_dict(sessions.conninfo(engine))
    assert parsed["host"] == "10.0.0.1,10.0.0.2" and parsed["port"] == "5433,5434"
    assert parsed["target_session_attrs"] == "read-write"
    assert (parsed["user"], parsed["password"], parsed["dbname"]) == ("app", "s3cret", "pay")


def test_the_session_check_is_one_statement_per_connection_not_per_statement(
    postgres_url: str,
) -> None:
    import psycopg

    sent: list[str] = []

    class Recording(psycopg.Cursor[Any]):
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            sent.append(str(query))
            return super().execute(query, params, **kwargs)

    engine = db.create_engine(
        postgres_url, pool_size=1, max_overflow=0, connect_args={"cursor_factory": Recording}
    )
    try:
        for _ in range(5):
            run_sql(engine, "SELECT 1", {}, write=False)
            db.run_in_transaction(engine, lambda c: c.exec_driver_sql("SELECT 2"), write=False)
    finally:
        engine.dispose()
    assert sent.count(sessions.ROLE_SQL) == 1
    assert sent.count("SELECT 1") == 5
