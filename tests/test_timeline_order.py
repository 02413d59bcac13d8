"""An operation's timeline is in the order its events were written, whatever the clocks of
the hosts that wrote them said (issue 34).

Event ids are UUIDv7 made from the writing host's clock. Here two "hosts" write one
operation's events in turn, one with a clock ten minutes fast and one ten minutes slow (the
ids are made as each would make them), and every reader must still give the write order:
the store's listing, ``payorch ops show`` (table and ``--json``) and the demo report's
"newest event". Ties in database time are broken by write order too, on both databases.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
import uuid6
from cli_helpers import claim, run, to_unknown

from payorch.cli._demo_report import attention_reasons
from payorch.core import State
from payorch.records import OperationRecord
from payorch.storage._store import Store
from payorch.storage._tables import events

SKEW = timedelta(minutes=10)
_UUID = uuid6.UUID  # the class, kept before uuid7 is patched


class Hosts:
    """Which host writes next: the ids it makes come from its own clock, ``skew`` off."""

    def __init__(self) -> None:
        self.skew = timedelta(0)

    def uuid7(self) -> uuid6.UUID:
        ms = int((time.time() + self.skew.total_seconds()) * 1000)
        return _UUID(int=(ms << 80) | secrets.randbits(76), version=7)

    def fast(self) -> None:
        self.skew = SKEW

    def slow(self) -> None:
        self.skew = -SKEW


@pytest.fixture
def hosts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hosts]:
    made = Hosts()
    # new_id() calls uuid6.uuid7() for every event id (and operation id).
    monkeypatch.setattr(uuid6, "uuid7", made.uuid7)
    yield made


WRITTEN = ["claimed", "provider_answer", "late_answer", "status_query", "webhook"]


def write_in_turn(store: Store, hosts: Hosts) -> OperationRecord:
    """One operation's events, written alternately by the fast and the slow host."""
    hosts.fast()
    record = claim(store, "k-skew")
    hosts.slow()
    unknown = to_unknown(store, record)
    hosts.fast()  # a stale worker's answer: moves nothing, carries no version
    store.append_event(unknown, kind="late_answer", actor="worker-1", detail={"late": True})
    hosts.slow()
    done = store.transition(
        unknown,
        State.SUCCEEDED,
        kind="status_query",
        actor="reconciler:b",
        provider_reference="eff_1",
        response={"status": "succeeded"},
    )
    hosts.fast()
    store.append_event(done, kind="webhook", actor="webhooks:a", detail={"result": "recorded"})
    return done


def test_the_store_lists_events_in_write_order_across_skewed_hosts(
    store: Store, hosts: Hosts
) -> None:
    done = write_in_turn(store, hosts)
    timeline = store.events(done.tenant_id, done.id)
    assert [e.kind for e in timeline] == WRITTEN
    # The ids alone would have put the slow host's events first.
    assert [e.kind for e in sorted(timeline, key=lambda e: e.id)] != WRITTEN
    times = [e.created_at for e in timeline]
    assert times == sorted(times)  # database time never runs backwards in a timeline


def test_ops_show_prints_the_timeline_in_write_order(
    db_url: str, store: Store, hosts: Hosts
) -> None:
    done = write_in_turn(store, hosts)
    shown = run(db_url, f"ops show {done.id} --json")
    assert shown.exit_code == 0, shown.output
    assert [e["kind"] for e in json.loads(shown.stdout)["events"]] == WRITTEN
    table = run(db_url, f"ops show {done.id}")
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    start = lines.index("timeline")
    kinds = [word for line in lines[start:] for word in line.split() if word in WRITTEN]
    assert kinds == WRITTEN


def insert_event(store: Store, record: OperationRecord, **values: object) -> None:
    with store.engine.begin() as conn:
        conn.execute(
            sa.insert(events).values(
                tenant_id=record.tenant_id, operation_id=record.id, actor="host", **values
            )
        )


def test_events_at_the_same_database_time_keep_their_write_order(store: Store) -> None:
    """One database instant (SQLite counts milliseconds): the later write still comes
    later though its id, from a slow host, is the smaller (rowid on SQLite; the version it
    was written at on PostgreSQL)."""
    record = claim(store, "k-tie")
    same = datetime(2031, 1, 1, 12, 0, 0, 123000, tzinfo=UTC)
    late, early = sorted(str(uuid6.uuid7()) for _ in range(2))  # late < early by id
    insert_event(store, record, id=early, kind="first", version=2, created_at=same)
    insert_event(store, record, id=late, kind="second", version=3, created_at=same)
    kinds = [e.kind for e in store.events(record.tenant_id, record.id)]
    assert kinds == ["claimed", "first", "second"]


def test_sqlite_breaks_a_tie_between_versionless_events_by_rowid(store: Store) -> None:
    if store.is_postgres:
        pytest.skip("rowid is SQLite's; PostgreSQL's microsecond clock reads each write apart")
    record = claim(store, "k-tie")
    same = datetime(2031, 1, 1, 12, 0, 0, 123000, tzinfo=UTC)
    ids = sorted((str(uuid6.uuid7()) for _ in range(3)), reverse=True)
    for n, event_id in enumerate(ids):  # each written later, each with a smaller id
        insert_event(store, record, id=event_id, kind=f"late_{n}", created_at=same)
    kinds = [e.kind for e in store.events(record.tenant_id, record.id)]
    assert kinds == ["claimed", "late_0", "late_1", "late_2"]


def test_the_demo_report_reads_the_newest_event_as_written(store: Store, hosts: Hosts) -> None:
    hosts.fast()
    unknown = to_unknown(store, claim(store, "k-flag", tenant="t1"))  # error code http_500
    hosts.slow()
    store.flag_attention(
        unknown,
        kind="conflicting_evidence",
        actor="reconciler:b",
        detail={"conflict": "other_terminal_state"},
    )
    with store.engine.connect() as conn:
        reasons = attention_reasons(conn, "t1")
    # The newest written explains the flag; by id it would be the fast host's answer.
    assert reasons == Counter({"conflicting_evidence [outcome_unknown]": 1})
