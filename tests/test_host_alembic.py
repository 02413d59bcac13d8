"""payorch's migrations beside a host application's own Alembic project (revision 0001).

(a) ``payorch db upgrade`` beside the host's migrations, each with its own version table;
(b) the host's ``alembic upgrade heads`` running payorch's revisions as a labelled branch.
Both on PostgreSQL and SQLite, plus the one-line refusals for databases payorch cannot
safely migrate.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from conftest import create_pg_database
from typer.testing import CliRunner

from payorch import migrate
from payorch.cli._app import app
from payorch.errors import ConfigurationError, OperationInProgress
from payorch.operations import default_registry
from payorch.storage._store import Store

HOST = Path(__file__).parent / "host_app"


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'host.db'}"
    server: str = request.getfixturevalue("pg_server_url")
    return create_pg_database(server, prefix="payorch_host")


def host_config(url: str, *, include_payorch: bool) -> Config:
    cfg = Config(stdout=io.StringIO())
    cfg.set_main_option("script_location", str(HOST))
    cfg.set_main_option("path_separator", "os")
    locations = [str(HOST / "versions")]
    if include_payorch:
        locations.append(str(migrate.versions_directory()))
    cfg.set_main_option("version_locations", ":".join(locations))
    rendered = sa.make_url(url).render_as_string(hide_password=False)
    if rendered.startswith("postgresql://"):
        rendered = rendered.replace("postgresql://", "postgresql+psycopg://", 1)
    cfg.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    return cfg


def tables_and_versions(url: str) -> tuple[set[str], dict[str, set[str]]]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            names = set(sa.inspect(conn).get_table_names())
            versions = {
                table: {row[0] for row in conn.execute(sa.text(f"SELECT version_num FROM {table}"))}
                for table in ("alembic_version", migrate.VERSION_TABLE)
                if table in names
            }
    finally:
        engine.dispose()
    return names, versions


def works(url: str) -> None:
    """payorch's tables are usable: a claim commits, and its namespace is then taken."""
    store = Store.from_url(url)
    try:
        prepared = default_registry("sandbox").prepare(
            tenant_id="host",
            operation="payment.create",
            idempotency_key=uuid.uuid4().hex,
            request={"amount": 100, "currency": "EUR", "payment_method": "pm_card"},
        )
        first = store.claim(prepared.new, owner="t", lease=timedelta(seconds=30))
        with pytest.raises(OperationInProgress) as busy:
            store.claim(prepared.new, owner="t", lease=timedelta(seconds=30))
    finally:
        store.close()
    assert first.created
    assert busy.value.operation_id == first.operation.id


def test_payorch_upgrade_beside_the_hosts_own_migrations(empty_url: str) -> None:
    command.upgrade(host_config(empty_url, include_payorch=False), "head")
    migrate.upgrade(empty_url)
    names, versions = tables_and_versions(empty_url)
    assert {"host_orders", "payorch_operations", "payorch_events"} <= names
    assert versions == {"alembic_version": {"0001"}, migrate.VERSION_TABLE: {"payorch_0007"}}
    assert migrate.current_revision(empty_url) == migrate.head_revision() == "payorch_0007"
    # Each side upgrades again as a no-op, in either order.
    migrate.upgrade(empty_url)
    command.upgrade(host_config(empty_url, include_payorch=False), "head")
    assert tables_and_versions(empty_url)[1] == versions
    works(empty_url)


def test_payorch_first_then_the_host(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    command.upgrade(host_config(empty_url, include_payorch=False), "head")
    names, versions = tables_and_versions(empty_url)
    assert "host_orders" in names
    assert versions == {"alembic_version": {"0001"}, migrate.VERSION_TABLE: {"payorch_0007"}}


def test_host_upgrade_heads_includes_payorchs_branch(empty_url: str) -> None:
    cfg = host_config(empty_url, include_payorch=True)
    command.upgrade(cfg, "heads")
    names, versions = tables_and_versions(empty_url)
    assert {"host_orders", "payorch_operations"} <= names
    assert versions == {"alembic_version": {"0001", "payorch_0007"}}
    works(empty_url)
    # The branch label addresses payorch's line alone.
    command.downgrade(cfg, "payorch@base")
    names, versions = tables_and_versions(empty_url)
    assert "payorch_operations" not in names and "host_orders" in names
    assert versions == {"alembic_version": {"0001"}}


def test_payorch_upgrade_refuses_a_database_the_host_migrates(empty_url: str) -> None:
    command.upgrade(host_config(empty_url, include_payorch=True), "heads")
    with pytest.raises(ConfigurationError, match="upgrade there"):
        migrate.upgrade(empty_url)


def _set_versions(url: str, revisions: list[str]) -> None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text(f"DELETE FROM {migrate.VERSION_TABLE}"))
        for rev in revisions:
            conn.execute(
                sa.text(f"INSERT INTO {migrate.VERSION_TABLE} (version_num) VALUES (:v)"),
                {"v": rev},
            )
    engine.dispose()


@pytest.mark.parametrize(
    ("revisions", "message"),
    [
        (["payorch_0001", "payorch_0002"], "holds 2 revisions"),
        ([], "records no revision"),
    ],
)
def test_unknown_revisions_get_one_line_errors(
    empty_url: str, revisions: list[str], message: str
) -> None:
    migrate.upgrade(empty_url)
    _set_versions(empty_url, revisions)
    with pytest.raises(ConfigurationError, match=message):
        migrate.upgrade(empty_url)
    with pytest.raises(ConfigurationError, match=message):
        migrate.current_revision(empty_url)
    result = CliRunner().invoke(app, ["db", "current", "--database-url", empty_url])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]
    assert "Traceback" not in result.output


def test_a_newer_revision_is_read_but_never_migrated(empty_url: str) -> None:
    """A newer payorch migrated the database (a rolling deploy, migrations first): this one
    shows where it stands and serves, but refuses to run its migrations over it."""
    migrate.upgrade(empty_url)
    _set_versions(empty_url, ["payorch_9999"])
    with pytest.raises(ConfigurationError, match="does not know"):
        migrate.upgrade(empty_url)
    assert migrate.current_revision(empty_url) == "payorch_9999"
    result = CliRunner().invoke(app, ["db", "current", "--database-url", empty_url])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == (
        f"current: payorch_9999  head: {migrate.head_revision()}  "
        "(newer than this payorch: roll the code forward)"
    )


def test_a_hosts_alembic_version_is_left_alone(empty_url: str) -> None:
    command.upgrade(host_config(empty_url, include_payorch=False), "head")
    result = CliRunner().invoke(app, ["db", "upgrade", "--database-url", empty_url])
    assert result.exit_code == 0, result.output
    assert "payorch_0007" in result.output
    assert tables_and_versions(empty_url)[1]["alembic_version"] == {"0001"}


@pytest.fixture
def schema_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"payments_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("PAYORCH_DB_SCHEMA", name)
    yield name


@pytest.mark.postgres
def test_a_postgresql_schema_keeps_payorchs_tables_apart(
    pg_server_url: str, schema_env: str
) -> None:
    url = create_pg_database(pg_server_url, prefix="payorch_schema")
    migrate.upgrade(url)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            inspector = sa.inspect(conn)
            assert "payorch_operations" not in inspector.get_table_names(schema="public")
            assert {"payorch_operations", migrate.VERSION_TABLE} <= set(
                inspector.get_table_names(schema=schema_env)
            )
    finally:
        engine.dispose()
    assert migrate.current_revision(url) == "payorch_0007"
    works(url)


def test_an_invalid_schema_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAYORCH_DB_SCHEMA", 'x"; DROP TABLE y; --')
    with pytest.raises(ConfigurationError, match="schema"):
        Store.from_url("postgresql+psycopg://u@127.0.0.1:1/db")
