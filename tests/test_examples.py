"""The README's embedding example runs as written (examples/embed.py), twice: the second run
(the same key, the same database) replays the first outcome and stores no second operation.
The outbox example (examples/after_the_payment.py) runs too. The FastAPI and Django
examples are served and driven by tests/test_fastapi.py and tests/test_django.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa

from payorch import Store

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "embed.py"


def _run(cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_embedding_example_pays_once_and_replays(tmp_path: Path) -> None:
    first = _run(tmp_path)
    assert first.startswith("200 ") and "'state': 'succeeded'" in first
    assert "Idempotent-Replayed" not in first
    second = _run(tmp_path)  # the same key against the same database: the first outcome
    assert second.startswith("200 ") and "'Idempotent-Replayed': 'true'" in second
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'payments.db'}")
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT id, state, attempts, replays FROM payorch_operations")
            ).all()
            logged = conn.execute(sa.text("SELECT count(*) FROM payorch_events")).scalar_one()
    finally:
        engine.dispose()
    # One operation, sent once (one attempt, one provider answer), answered twice.
    ((operation_id, state, attempts, replays),) = rows
    assert (state, attempts, replays) == ("succeeded", 1, 1)
    assert operation_id in first and operation_id in second
    # Uneventful: its claim and answer are kept on its row, no event row is written.
    store = Store.from_url(f"sqlite:///{tmp_path / 'payments.db'}")
    try:
        timeline = [(e.kind, e.version) for e in store.events("shop-1", operation_id)]
    finally:
        store.close()
    assert timeline == [("claimed", 1), ("provider_answer", 2)]
    assert logged == 0


AFTER = EXAMPLE.parent / "after_the_payment.py"


def test_after_the_payment_one_receipt_and_one_ledger_entry_whatever_failed(
    tmp_path: Path,
) -> None:
    # docs/outbox.md's worked example: a client retry, a relay failing after the hand-over
    # and a lost mailer answer on the way; still one of each.
    done = subprocess.run(
        [sys.executable, str(AFTER)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "payment succeeded; effects at the acquirer: 1",
        "receipts sent: 1 (mailer called 2 times)",
        "ledger entries: 1",
    ]
