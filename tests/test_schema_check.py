"""The start-up schema check (``Store.check_schema``, ``AsyncStore.check_schema``) and the
problem details of storage errors.

On SQLite and PostgreSQL: a database without payorch's tables, at an older revision, at a
revision this install does not know, or migrated by a host's own Alembic project; one read
when it passes; and what a client reads in a storage error's ``detail``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory
from conftest import LoopThread, create_pg_database

from payorch import errors, migrate
from payorch.http import http_answer
from payorch.storage._async_store import AsyncStore
from payorch.storage._distribution import read_placement
from payorch.storage._schema import FORWARD_HINT, VERSION_TABLE, known_revisions, shown_url
from payorch.storage._store import Store

HEAD = known_revisions()[0]
# What a client reads for SchemaNotReady: true whether the schema is older or newer.
NEUTRAL = (
    "payorch's tables do not match this release: an operator must align the schema and the "
    "code (`payorch db upgrade`, or roll the code forward)"
)


def fresh_pg_database(request: pytest.FixtureRequest, server_url: str) -> str:
    """A database of its own on the test server, dropped when the test ends."""
    url = create_pg_database(server_url, prefix="payorch_schema")
    name = sa.make_url(url).database

    def drop() -> None:
        admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            admin.dispose()

    request.addfinalizer(drop)
    return url


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fresh.db'}"
    return fresh_pg_database(request, request.getfixturevalue("pg_server_url"))


@pytest.fixture
def fresh_store(empty_url: str) -> Iterator[Store]:
    s = Store.from_url(empty_url)
    try:
        yield s
    finally:
        s.close()


def previous_revision() -> str:
    script = ScriptDirectory(str(migrate.script_directory()))
    down = script.get_revision(HEAD).down_revision
    assert isinstance(down, str)
    return down


def refusal(store: Store) -> errors.SchemaNotReady:
    with pytest.raises(errors.SchemaNotReady) as caught:
        store.check_schema()
    return caught.value


def test_no_tables_is_refused_with_the_command(fresh_store: Store, empty_url: str) -> None:
    err = refusal(fresh_store)
    assert "no payorch tables" in err.message and HEAD in err.message
    assert "run `payorch db upgrade`" in err.message
    assert isinstance(err, errors.ConfigurationError) and isinstance(err, errors.StorageError)

    answer = http_answer(err)
    assert answer.status == 503 and int(answer.headers["Retry-After"]) >= 1
    assert answer.body["type"] == "urn:payorch:problem:schema-not-ready"
    assert answer.body["retry"] == "same_key"
    detail = answer.body["detail"]
    assert detail.startswith(NEUTRAL) and "nothing was written" in detail
    assert "same idempotency key" in detail and "Retry-After" in detail
    assert sa.make_url(empty_url).render_as_string(hide_password=True) not in detail

    migrate.upgrade(empty_url)
    assert fresh_store.check_schema() == HEAD


def test_an_older_revision_names_both_and_the_command(fresh_store: Store, empty_url: str) -> None:
    older = previous_revision()
    migrate.upgrade(empty_url, older)
    err = refusal(fresh_store)
    assert f"is at payorch revision {older}; this payorch needs {HEAD}" in err.message
    assert "run `payorch db upgrade`" in err.message
    migrate.upgrade(empty_url)
    assert fresh_store.check_schema() == HEAD


def test_a_newer_revision_is_served_with_one_warning_naming_both(
    fresh_store: Store, empty_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A rolling deploy migrates first: the previous release restarts on a database a newer
    payorch migrated, and serves (a migration keeps it working), saying so once."""
    migrate.upgrade(empty_url)
    with fresh_store.engine.begin() as conn:
        conn.execute(
            sa.text(f"UPDATE {VERSION_TABLE} SET version_num = :v"), {"v": "payorch_9999_later"}
        )
    with caplog.at_level(logging.DEBUG, logger="payorch"):
        assert fresh_store.check_schema() == "payorch_9999_later"
    said = [r for r in caplog.records if r.name.startswith("payorch")]
    assert [(r.name, r.levelno) for r in said] == [("payorch.db", logging.WARNING)]
    line = said[0].getMessage()
    assert "payorch_9999_later" in line and HEAD in line and FORWARD_HINT in line
    assert "\n" not in line
    with pytest.raises(errors.OperationNotFound):  # and the store serves
        fresh_store.get("t-1", str(uuid.uuid4()))


def test_two_revisions_are_refused(fresh_store: Store, empty_url: str) -> None:
    migrate.upgrade(empty_url)
    with fresh_store.engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {VERSION_TABLE} (version_num) VALUES ('payorch_x')"))
    assert "records 2 payorch revisions" in refusal(fresh_store).message


def test_a_host_alembic_project_that_runs_payorchs_migrations_passes(
    fresh_store: Store, empty_url: str
) -> None:
    from test_host_alembic import host_config

    command.upgrade(host_config(empty_url, include_payorch=True), "heads")
    assert fresh_store.check_schema() == HEAD
    with fresh_store.engine.begin() as conn:  # payorch's line left behind by the host
        conn.execute(sa.text("DELETE FROM alembic_version WHERE version_num LIKE 'payorch_%'"))
    assert "no revision is recorded" in refusal(fresh_store).message


def test_the_async_store_checks_alike(empty_url: str, loop_thread: LoopThread) -> None:
    async def check() -> str | errors.SchemaNotReady:
        async with AsyncStore.from_url(empty_url) as astore:
            try:
                return await astore.check_schema()
            except errors.SchemaNotReady as exc:
                return exc

    refused = loop_thread.run(check())
    assert isinstance(refused, errors.SchemaNotReady) and "no payorch tables" in refused.message
    migrate.upgrade(empty_url)
    assert loop_thread.run(check()) == HEAD


def test_a_statement_on_a_missing_table_is_schema_not_ready(fresh_store: Store) -> None:
    with pytest.raises(errors.SchemaNotReady, match="run `payorch db upgrade`") as caught:
        fresh_store.get("t-1", str(uuid.uuid4()))
    # The database may as well be newer than the code: both ways out are named.
    assert "roll the code forward" in caught.value.message
    assert http_answer(caught.value).body["detail"].startswith(NEUTRAL)


def test_the_check_is_one_read(store: Store) -> None:
    store.db_time()  # the connection's first use (PostgreSQL: its role check) is done
    seen: list[str] = []

    def record(conn: object, cursor: object, statement: str, *args: object) -> None:
        seen.append(statement)

    sa.event.listen(store.engine, "before_cursor_execute", record)
    try:
        assert store.check_schema() == HEAD
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", record)
    reads = [s for s in seen if not s.strip().upper().startswith(("BEGIN", "COMMIT", "ROLLBACK"))]
    # One read; where Citus is installed, the tables' placement is read after it.
    assert VERSION_TABLE in reads[0]
    placement = [s for s in reads[1:] if "pg_extension" in s or "pg_dist_" in s]
    assert reads[1:] == placement
    assert bool(placement) == (read_placement(store.engine).citus is not None)


STORAGE_ERRORS = [
    (errors.SchemaNotReady("x"), NEUTRAL),
    (errors.DatabaseReadOnly("x"), "pointed at the primary"),
    (errors.SyncStandbyUnavailable("x"), "no synchronous standby is streaming"),
    (errors.DatabaseUnavailable("x"), "could not be reached"),
    (errors.CorruptRecord("x", tenant_id="t", operation_id="o", problem="json"), "operator"),
    (errors.OutcomeNotRecorded("x"), "may have reached the provider"),
    (errors.StorageError("x"), "the database failed"),
]


@pytest.mark.parametrize(("err", "says"), STORAGE_ERRORS, ids=lambda v: type(v).__name__)
def test_every_storage_detail_says_what_failed_and_to_keep_the_key(
    err: errors.StorageError, says: str
) -> None:
    answer = http_answer(err)
    assert answer.status == 503 and answer.body["retry"] == "same_key"
    assert says in answer.body["detail"]
    assert "retry with the same idempotency key after Retry-After" in answer.body["detail"]


def test_a_database_url_in_an_error_never_reaches_the_client() -> None:
    secret = "postgresql+psycopg://payments:s3cr3t-pw@127.0.0.1:5432/shop"
    for cls in (errors.StorageError, errors.DatabaseUnavailable, errors.SchemaNotReady):
        detail = http_answer(cls(f"connection to {secret} failed")).body["detail"]
        assert "s3cr3t-pw" not in detail and "127.0.0.1" not in detail


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://shop:n3tl0c-pw@127.0.0.1:5432/shop",
        "postgresql+psycopg://shop@127.0.0.1/shop?password=qu3ry-pw",
        "postgresql+psycopg://shop@127.0.0.1/shop?sslpassword=k3y-pw&sslmode=require",
        "postgresql+psycopg://shop:n3tl0c-pw@127.0.0.1/shop?password=qu3ry-pw&passfile=/run/pgpass",
    ],
)
def test_a_shown_url_masks_every_password(url: str) -> None:
    shown = shown_url(sa.make_url(url))
    assert not any(secret in shown for secret in ("n3tl0c-pw", "qu3ry-pw", "k3y-pw"))
    assert "***" in shown and "127.0.0.1" in shown and "/shop" in shown
    if "passfile" in url:  # a path, not a secret
        assert "passfile=/run/pgpass" in shown


def test_a_refusal_never_shows_the_password_of_its_url(
    request: pytest.FixtureRequest, pg_server_url: str
) -> None:
    """A real check on PostgreSQL (trust authentication: the passwords are sent, unused)."""
    url = sa.make_url(fresh_pg_database(request, pg_server_url))
    secret_url = url.set(password="n3tl0c-pw").update_query_dict(
        {"password": "qu3ry-pw", "application_name": "shop"}
    )
    s = Store.from_url(secret_url.render_as_string(hide_password=False))
    try:
        err = refusal(s)
    finally:
        s.close()
    assert "no payorch tables in postgresql+psycopg://" in err.message
    assert "n3tl0c-pw" not in err.message and "qu3ry-pw" not in err.message
    assert ":***@" in err.message and "password=***" in err.message
    assert "application_name=shop" in err.message


def test_a_role_that_may_not_read_the_version_table_is_told_the_grant(
    request: pytest.FixtureRequest, pg_server_url: str
) -> None:
    url = sa.make_url(fresh_pg_database(request, pg_server_url))
    migrate.upgrade(url.render_as_string(hide_password=False))
    role = f"payorch_noread_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE ROLE "{role}" LOGIN')
        s = Store.from_url(url.set(username=role).render_as_string(hide_password=False))
        try:
            err = refusal(s)
        finally:
            s.close()
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP ROLE IF EXISTS "{role}"')
        admin.dispose()
    assert "permission denied" in err.message
    assert f"grant SELECT on {VERSION_TABLE} to the application's role" in err.message
