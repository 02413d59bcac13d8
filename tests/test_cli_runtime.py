"""The CLI's stats, durations, database errors and reconciler, also as a real process."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from cli_helpers import World, claim, make_world, one_error_line, run, runner

from payorch.cli._app import app
from payorch.cli._runtime import parse_duration
from payorch.core import State
from payorch.storage._queries import stats
from payorch.storage._store import Store

PAYORCH = Path(sys.executable).with_name("payorch")


@pytest.fixture
def world(store: Store) -> World:
    return make_world(store)


# -- stats, durations, databases ---------------------------------------------------------


def test_stats(db_url: str, store: Store, world: World) -> None:
    assert claim(store, "k-ok").id == world.succeeded.id  # two replays, counted on the row
    assert claim(store, "k-ok").id == world.succeeded.id
    store.append_event(world.failed, kind="key_reused", actor="executor", detail={})
    result = run(db_url, "stats", "--json", "--window", "1h")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["by_state"] == {
        "in_progress": 2,
        "outcome_unknown": 2,
        "succeeded": 1,
        "failed_final": 1,
    }
    assert data["needs_attention"] == 1
    assert (data["replays"], data["replayed_operations"], data["conflicts"]) == (2, 1, 1)
    assert data["by_provider"]["stripe"] == {"outcome_unknown": 1}
    assert data["oldest_unknown_created_at"] == world.unknown.created_at.isoformat()
    assert data["oldest_unknown_age_seconds"] >= 0
    assert stats(store, window=timedelta(hours=1), tenant_id="shop-b").total == 2
    table = run(db_url, "stats")
    assert table.exit_code == 0
    assert "1 operations replayed" in table.stdout and "replays in all: 2" in table.stdout
    assert "needs attention: 1" in table.stdout


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("15m", 900), ("2h", 7200), ("1d", 86400), ("1h30m", 5400), ("0s", 0)],
)
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "15", "m", "15 minutes", "-5m", "1.5.2h", "5x"])
def test_malformed_duration_is_a_usage_error(db_url: str, text: str) -> None:
    result = run(db_url, "ops", "list", "--older-than", text)
    assert result.exit_code == 2
    assert "--older-than" in one_error_line(result)


def test_unreachable_database_is_one_line(tmp_path: Path) -> None:
    down = runner.invoke(
        app, ["ops", "list", "--database-url", "postgresql+psycopg://postgres@127.0.0.1:1/x"]
    )
    assert down.exit_code == 1
    assert "database unavailable" in one_error_line(down)
    missing = runner.invoke(
        app, ["ops", "list", "--database-url", f"sqlite:///{tmp_path / 'absent.db'}"]
    )
    assert missing.exit_code == 1
    assert "no database at" in one_error_line(missing)
    assert not (tmp_path / "absent.db").exists()


# -- the reconciler from the command line ----------------------------------------------


def test_reconcile_once_settles_what_is_due(db_url: str, store: Store, world: World) -> None:
    result = run(db_url, "reconcile once --json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"picked": 1, "outcomes": {"abandoned": 1}, "released": 0}
    # Nothing was sent: released (no outcome stored), the key's next request runs it again.
    abandoned = store.get(world.abandoned.tenant_id, world.abandoned.id)
    assert abandoned.released and abandoned.state is State.IN_PROGRESS
    assert abandoned.lease_owner is None and abandoned.response is None
    assert "nothing due" in run(db_url, "reconcile once").stdout


# -- a real process ----------------------------------------------------------------------


def payorch(db_url: str, command: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
    return subprocess.run(
        [str(PAYORCH), *shlex.split(command), "--database-url", db_url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_real_subprocess(db_url: str, world: World) -> None:
    ok = payorch(db_url, "ops list --json --needs-attention")
    assert ok.returncode == 0, ok.stderr
    assert [i["id"] for i in json.loads(ok.stdout)["items"]] == [world.flagged.id]
    bad = payorch(db_url, "ops list --older-than soon")
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: ")
    refused = payorch(
        db_url, f"ops resolve {world.succeeded.id} --as failed_final --reason r --actor a --yes"
    )
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1 and "terminal" in refused.stderr
    assert "Traceback" not in bad.stderr + refused.stderr


def test_reconcile_run_stops_on_sigterm(db_url: str, world: World) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
    argv = [str(PAYORCH), "reconcile", "run", "--interval", "0.2", "--database-url", db_url]
    argv += ["--metrics-addr", "127.0.0.1:0"]  # a free port: the default may be taken here
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stderr is not None
        seen: list[str] = []
        # The replication mode, "started", the monitor's line, then the first pass.
        while len(seen) < 5 and not any("abandoned=1" in line for line in seen):
            seen.append(proc.stderr.readline())
        assert "abandoned=1" in seen[-1], seen  # the first pass settles it
        assert any("a pass every 0.2s" in line for line in seen[:-1]), seen
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    assert stdout.startswith("stopped after")
