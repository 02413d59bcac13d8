"""The start-up line ``database.replication`` says what the mode means, and warns only when
something is at risk (issue 34): a database without a standby is INFO, not a WARNING in
every process's log; asynchronous replication is a WARNING that says what a failover may
lose and what keeps the provider from charging twice."""

from __future__ import annotations

import logging

import pytest

from payorch.storage._replication import MEANINGS, Status, report
from payorch.storage._store import Store


def lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", "") == "database.replication"]


def reported(caplog: pytest.LogCaptureFixture, status: Status, *, strict: bool = False) -> str:
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="payorch.db"):
        report(status, strict=strict)
    [line] = lines(caplog)
    return f"{logging.getLevelName(line.levelno)} {line.getMessage()}"


def test_the_start_up_line_of_each_store_says_what_its_mode_means(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    # The test server has no standby (PostgreSQL: none); SQLite is local.
    with caplog.at_level(logging.DEBUG, logger="payorch.db"):
        status = store.replication.check()
    [line] = lines(caplog)
    assert status.mode == ("none" if store.is_postgres else "local")
    assert line.levelno == logging.INFO
    assert f"mode={status.mode}" in line.getMessage()
    assert getattr(line, "meaning", None) == MEANINGS[status.mode]
    assert MEANINGS[status.mode] in line.getMessage()


def test_no_standby_is_info_and_says_no_failover_can_lose_a_commit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    text = reported(caplog, Status(mode="none", synchronous_commit="on"))
    assert text.startswith("INFO database.replication mode=none")
    assert "no standby" in text and "no failover can lose a commit" in text


def test_async_is_a_warning_that_says_what_a_failover_may_lose(
    caplog: pytest.LogCaptureFixture,
) -> None:
    status = Status(mode="async", synchronous_commit="on", standbys_streaming=1)
    text = reported(caplog, status)
    assert text.startswith("WARNING database.replication mode=async")
    assert "a failover may lose the newest commits" in text
    assert "keeps the provider from charging twice" in text


@pytest.mark.parametrize(
    ("mode", "level", "says"),
    [
        ("sync", "INFO", "a failover loses no commit"),
        ("local", "INFO", "SQLite"),
        ("sync_blocked", "WARNING", "writes hang"),
        ("unknown", "WARNING", "GRANT pg_monitor"),
    ],
)
def test_each_mode_has_its_level_and_meaning(
    caplog: pytest.LogCaptureFixture, mode: str, level: str, says: str
) -> None:
    text = reported(caplog, Status(mode=mode))
    assert text.startswith(f"{level} database.replication mode={mode}")
    assert says in text


def test_a_strict_store_without_a_synchronous_standby_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert reported(caplog, Status(mode="none"), strict=True).startswith("WARNING")
    assert reported(caplog, Status(mode="sync"), strict=True).startswith("INFO")
