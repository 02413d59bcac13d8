"""What a newcomer meets first: the help, one-line errors, piped output, the daemon's start.

Each test runs the real command (CliRunner, or a subprocess where a terminal, a pipe or a
port matters) and asserts what the operator sees: the text, the exit code, the state.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from cli_helpers import World, make_world, one_error_line, runner

from payorch.cli._app import app
from payorch.reconciling._daemon import ReconcilerDaemon
from payorch.reconciling._reconciler import Reconciler
from payorch.storage._schema import VERSION_TABLE, known_revisions
from payorch.storage._store import Store

PAYORCH = Path(sys.executable).with_name("payorch")
WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}  # help on one line per option


def help_of(*path: str) -> str:
    result = runner.invoke(app, [*path, "--help"], env=WIDE)
    assert result.exit_code == 0, result.output
    return result.stdout


def command_paths() -> list[tuple[str, ...]]:
    """Every command and group of ``payorch``, as the words that name it."""
    import typer

    paths: list[tuple[str, ...]] = []

    def walk(command: object, path: tuple[str, ...]) -> None:
        paths.append(path)
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, (*path, name))

    walk(typer.main.get_command(app), ())
    return paths


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
    env.update(extra)
    return env


def payorch(*args: str, env: dict[str, str], stdout: int | None = subprocess.PIPE) -> str:
    """Run the installed command with stdout to a pipe (never a terminal); its stdout."""
    done = subprocess.run(
        [str(PAYORCH), *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout


# -- help ---------------------------------------------------------------------------------


def test_no_help_shows_a_value_for_a_flag() -> None:
    paths = command_paths()
    assert ("ops", "list") in paths and ("reconcile", "run") in paths
    for path in paths:
        text = help_of(*path)
        assert "<bool>" not in text, (path, text)
        assert "--help" in text
    listing = help_of("ops", "list")
    json_line = next(line for line in listing.splitlines() if "│ --json" in line)
    assert "Print JSON instead of a table." in json_line
    assert "<" not in json_line  # the flag alone: nothing suggests `--json true`


def test_a_flag_given_a_value_is_one_usage_line() -> None:
    result = runner.invoke(app, ["ops", "list", "--json", "true"])
    assert result.exit_code == 2
    line = one_error_line(result)
    assert "true" in line and "--help" in line


def test_the_window_help_names_its_default() -> None:
    text = " ".join(help_of("stats").split())
    assert "over this window. [default: 24h]" in text
    assert "window ." not in text


# -- one-line errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        (
            "PAYORCH_LEASE_SECONDS",
            "-1",
            "error: PAYORCH_LEASE_SECONDS: Input should be greater than 0 "
            "(fix the setting and run again)",
        ),
        (
            "PAYORCH_DATABASE_URL",
            "",
            "error: PAYORCH_DATABASE_URL is set but empty: set a SQLAlchemy URL (e.g. "
            "sqlite:///payorch.db) or unset it (fix the setting and run again)",
        ),
    ],
)
def test_a_refused_setting_is_one_line_in_payorchs_words(
    tmp_path: Path, name: str, value: str, expected: str
) -> None:
    result = runner.invoke(app, ["stats"], env={name: value})
    assert result.exit_code == 1
    assert one_error_line(result) == expected
    assert "Value error" not in result.output and "pydantic" not in result.output


def test_a_refused_provider_setting_is_one_line_where_a_provider_is_called(db_url: str) -> None:
    env = {"PAYORCH_STRIPE_IDEMPOTENCY_WINDOW_SECONDS": "-1"}
    # A command that calls no provider never reads it.
    assert runner.invoke(app, ["stats", "--database-url", db_url], env=env).exit_code == 0
    result = runner.invoke(app, ["reconcile", "once", "--database-url", db_url], env=env)
    assert result.exit_code == 1
    assert one_error_line(result) == (
        "error: PAYORCH_STRIPE_IDEMPOTENCY_WINDOW_SECONDS: Input should be greater than or "
        "equal to 0 (fix the setting and run again)"
    )


def test_an_empty_database_url_is_refused_not_replaced(db_url: str, world: World) -> None:
    # The environment names a working database: an empty option must not fall back to it.
    for args in (["ops", "list"], ["db", "current"], ["demo", "--payments", "1"]):
        result = runner.invoke(
            app, [*args, "--database-url", ""], env={"PAYORCH_DATABASE_URL": db_url}
        )
        assert result.exit_code == 2, (args, result.output)
        line = one_error_line(result)
        assert "'--database-url': must not be empty" in line
        assert "PAYORCH_DATABASE_URL" in line
        assert world.live.id not in result.output
    listed = runner.invoke(app, ["ops", "list", "--json"], env={"PAYORCH_DATABASE_URL": db_url})
    assert listed.exit_code == 0 and world.live.id in listed.stdout


# -- output to a pipe or a file -----------------------------------------------------------


def test_piped_tables_are_not_padded(db_url: str, world: World, tmp_path: Path) -> None:
    env = clean_env(PAYORCH_DATABASE_URL=db_url)
    shown = tmp_path / "show.txt"
    with shown.open("w") as file:  # a file, as `> show.txt` makes it
        payorch("ops", "show", world.unknown.id, env=env, stdout=file.fileno())
    outputs = {
        "ops show": shown.read_text(),
        "ops list": payorch("ops", "list", env=env),
        "ops list --needs-attention": payorch("ops", "list", "--needs-attention", env=env),
        "stats": payorch("stats", env=env),
        "keys reap --dry-run": payorch("keys", "reap", "--dry-run", env=env),
        "outbox list": payorch("outbox", "list", env=env),
        "--help": payorch("--help", env=env),  # typer's panels
        "ops list --help": payorch("ops", "list", "--help", env=env),
    }
    for name, text in outputs.items():
        lines = text.splitlines()
        assert lines, name
        padded = [line for line in lines if line != line.rstrip()]
        assert not padded, (name, padded[:3])
    show = outputs["ops show"].splitlines()
    assert show[0].split() == ["operation", world.unknown.id, "(payment.create)"]
    timeline = [line for line in show if "provider_answer" in line]
    assert timeline and "outcome_unknown" in timeline[0] and "code=http_500" in timeline[0]
    rows = outputs["ops list"].splitlines()
    assert rows[0].split()[:3] == ["!", "id", "tenant"]
    assert sum(1 for row in rows if world.flagged.id in row) == 1
    assert max(len(row) for row in rows) < 200  # as wide as its widest row, no wider


# -- the daemon's start -------------------------------------------------------------------


def test_a_taken_metrics_port_refuses_before_started(db_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [str(PAYORCH), "reconcile", "run", "--metrics", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            env=clean_env(PAYORCH_DATABASE_URL=db_url),
            timeout=60,
            check=False,
        )
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: cannot serve metrics on 127.0.0.1:{port}: ")
    assert "started" not in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""


@pytest.fixture
def older_revision(store: Store) -> Iterator[str]:
    """The database's payorch revision set back one step (restored afterwards: the
    PostgreSQL database is shared by the session's tests)."""
    head, known = known_revisions()
    older = sorted(r for r in known if r != head)[-1]

    def record(revision: str) -> None:
        with store.engine.begin() as conn:
            conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = :r"), {"r": revision})

    record(older)
    try:
        yield older
    finally:
        record(head)


def refused_start(args: list[str], url: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(PAYORCH), *args],
        capture_output=True,
        text=True,
        env=clean_env(PAYORCH_DATABASE_URL=url, PAYORCH_METRICS_ADDR="127.0.0.1:0"),
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: ") and "`payorch db upgrade`" in done.stderr
    assert "started" not in done.stderr and "Traceback" not in done.stderr
    return done


@pytest.mark.parametrize("command", [["reconcile", "once"], ["reconcile", "run"]])
def test_the_reconciler_refuses_an_older_schema(
    db_url: str, world: World, older_revision: str, command: list[str], store: Store
) -> None:
    done = refused_start(command, db_url)
    assert f"at payorch revision {older_revision}" in done.stderr
    # Nothing was leased or settled: the abandoned claim is as it was.
    assert store.get(world.abandoned.tenant_id, world.abandoned.id).version == (
        world.abandoned.version
    )


@pytest.mark.parametrize("command", [["reconcile", "once"], ["reconcile", "run"]])
def test_the_reconciler_refuses_a_database_without_payorch(
    tmp_path: Path, command: list[str]
) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()  # exists (so not "no database at"), holds no tables
    done = refused_start(command, f"sqlite:///{empty}")
    assert "no payorch tables in" in done.stderr


def readyz(url: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=10) as client:
        return client.get("/readyz")


def test_readyz_names_the_upgrade_when_the_schema_falls_behind(store: Store) -> None:
    daemon = ReconcilerDaemon(
        Reconciler(store=store, providers=[]),
        interval=timedelta(seconds=30),
        monitor=("127.0.0.1", 0),
    )
    started = threading.Event()
    runner_thread = threading.Thread(
        target=daemon.run,
        kwargs={"install_signal_handlers": False, "on_start": started.set},
        daemon=True,
    )
    runner_thread.start()
    try:
        assert started.wait(30)
        assert daemon.monitor is not None
        url = daemon.monitor.url
        assert readyz(url).status_code == 200
        head, known = known_revisions()
        older = sorted(r for r in known if r != head)[-1]
        with store.engine.begin() as conn:
            conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = :r"), {"r": older})
        try:
            answer = readyz(url)
            assert answer.status_code == 503
            assert answer.text.startswith("not ready: ")
            assert "`payorch db upgrade`" in answer.text and older in answer.text
        finally:
            with store.engine.begin() as conn:
                conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = :r"), {"r": head})
        assert readyz(url).status_code == 200
    finally:
        daemon.stop_event.set()
        runner_thread.join(timeout=30)
    assert not runner_thread.is_alive()


@pytest.fixture
def world(store: Store) -> World:
    return make_world(store)


@pytest.mark.parametrize("flag", ["--log-format", "--log-level"])
def test_a_global_flag_after_the_command_says_where_it_goes(flag: str) -> None:
    value = "json" if flag == "--log-format" else "info"
    result = runner.invoke(app, ["reconcile", "run", flag, value])
    assert result.exit_code == 2
    line = one_error_line(result)
    assert f"{flag} is a global option: put it before the command" in line
