"""examples/flask_app.py as its docstring runs it: ``flask --app examples/flask_app.py run``
(werkzeug's threaded server, a real process), on SQLite and PostgreSQL. Against a database
nobody migrated it refuses to start and names ``payorch db upgrade``; after the real
``payorch db upgrade`` it serves a payment, its replay and the operation resource, with one
effect at the sandbox."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from served_contract import PROBLEM, Stack, database, post, served_env
from server_process import ROOT, Command, ServerProcess, refused_start

from payorch.providers.sandbox import SandboxServer

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "flask_app.py"
PAYORCH = Path(sys.executable).with_name("payorch")


def flask_run(port: int) -> list[str]:
    # `flask --app … run`, through this interpreter (the one with payorch installed).
    flask = [sys.executable, "-m", "flask", "--app", str(EXAMPLE), "run"]
    return [*flask, "--host", "127.0.0.1", "--port", str(port)]


SERVER: Command = flask_run


@pytest.fixture(params=["sqlite", "postgres"])
def unmigrated(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield from database(request, tmp_path, "payorch_flask_example", migrated=False)


def test_the_example_refuses_an_unmigrated_database_then_serves(
    unmigrated: str, sandbox: SandboxServer
) -> None:
    env = served_env(unmigrated, sandbox)
    refused = refused_start(SERVER, env=env)
    assert refused.returncode != 0
    assert "payorch db upgrade" in refused.stderr, refused.stderr

    upgrade = subprocess.run(
        [str(PAYORCH), "db", "upgrade"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert upgrade.returncode == 0, upgrade.stderr

    engine = sa.create_engine(unmigrated)
    try:
        with (
            ServerProcess(SERVER, env=env) as server,
            httpx.Client(base_url=server.url, timeout=30.0) as client,
        ):
            stack = Stack(url=server.url, sandbox=sandbox, engine=engine)
            first = post(client, "shop-1", '"order-1"')
            assert first.status_code == 201, first.text
            op_id = first.json()["operation_id"]
            replay = post(client, "shop-1", "order-1")  # the bare form: the same key
            assert replay.content == first.content
            assert replay.headers["Idempotent-Replayed"] == "true"
            polled = client.get(first.headers["Location"], headers={"X-Tenant-Id": "shop-1"})
            assert polled.status_code == 200 and polled.json()["operation_id"] == op_id
            assert json.loads(first.content)["state"] == "succeeded"
            no_tenant = post(client, None, "order-2")  # the header resolver: missing is 400
            assert no_tenant.status_code == 400 and no_tenant.headers["content-type"] == PROBLEM
            assert len(stack.effects("shop-1")) == 1 and stack.rows("shop-1") == 1
    finally:
        engine.dispose()


def script_run(port: int) -> list[str]:
    # `python examples/flask_app.py --port …`: the example's own entry point.
    return [sys.executable, str(EXAMPLE), "--host", "127.0.0.1", "--port", str(port)]


def test_run_as_a_script_it_refuses_in_one_line_then_serves(
    tmp_path: Path, sandbox: SandboxServer
) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    env = served_env(url, sandbox)
    refused = refused_start(script_run, env=env)
    assert refused.returncode == 1, refused.stderr
    # Its entry point is payorch's: the reason and the command to run, not a traceback.
    [line] = refused.stderr.splitlines()
    assert line.startswith("payorch cannot start: no payorch tables"), line
    assert "run `payorch db upgrade`" in line

    upgrade = [str(PAYORCH), "db", "upgrade"]
    done = subprocess.run(
        upgrade, env={**os.environ, **env}, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    with (
        ServerProcess(script_run, env=env) as server,
        httpx.Client(base_url=server.url, timeout=30.0) as client,
    ):
        made = post(client, "shop-1", '"order-1"')
        assert made.status_code == 201, made.text
        assert json.loads(made.content)["state"] == "succeeded"
