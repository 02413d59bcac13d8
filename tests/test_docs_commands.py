"""Every command the docs show is run, as written, so the docs cannot drift from the CLI.

The commands are the lines of README.md's and docs/*.md's fenced blocks marked ``sh``,
``shell``, ``bash`` or ``console`` that start with ``payorch `` or ``$ payorch `` (leading
``NAME=value`` assignments are the command's environment; a trailing ``\\`` continues it;
``# …`` is a comment; what follows an unquoted ``|`` is the reader's, not payorch's, and is
left out, as is a trailing ``&``). ``make …`` lines, and README's ``make demo``/``make
test``, are not run again (the suite is one of them): each must name a Makefile target.
Blocks marked ``text`` or ``python`` are illustrations and are not read.

Each command runs as a real process on its own copy of one throwaway SQLite database
(``PAYORCH_DATABASE_URL``), migrated with ``payorch db upgrade`` and seeded through the
library with operations in the states the commands need, next to a real sandbox acquirer
and a Stripe-shaped emulator on loopback for the commands that ask a provider. The ids
and placeholders the docs show are replaced by seeded ones through the table below. A
confirmation is answered "y", as the docs answer it. A command must exit 0, or with the
code the doc shows for it (``$ echo $?`` after it, or an ``error:`` line as its output:
non-zero), and print no traceback.

Long-running commands (``reconcile run``, ``sandbox serve``, ``outbox relay`` without
``--once``) are started, waited on until they say they are ready (bounded), and stopped with
SIGTERM; they must then exit 0. Their ports are made free ones (``--port 0``,
``PAYORCH_METRICS_ADDR=127.0.0.1:0``): a fixed port may be taken where the suite runs.
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO

import pytest
import sqlalchemy as sa
from cli_helpers import claim, to_unknown
from outbox_apps import hooks

from payorch.core import State
from payorch.provider.settlement import Entry, ReportEntry, write_adyen_settlement
from payorch.providers.sandbox import SandboxServer
from payorch.providers.stripe.emulator import API_KEY, StripeEmulator
from payorch.storage._store import Store
from payorch.storage._tables import outbox

ROOT = Path(__file__).resolve().parents[1]
PAYORCH = Path(sys.executable).with_name("payorch")
SHELLS = {"sh", "shell", "bash", "console"}
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
TIMEOUT = 120.0  # seconds, for one command, or for a long-running one to say it is ready

# What the docs name -> the seeded value (a role of `seed()`, or a literal).
SUBSTITUTIONS: dict[str, str] = {
    # docs/operators.md's example operations
    "01a22bde-98fd-72e6-929d-74b4c5b28fb1": "@flagged_unknown",
    "01a22bde-9910-7abb-82ec-b51ef341f4ee": "@unknown",
    "01a22d1c-1789-7667-be17-45cc9f9ca640": "@flagged_succeeded",
    # placeholders
    "ID": "@unknown",
    "<id>": "@unknown",
    "OPERATION_ID": "@unknown",
    "T": "shop-1",
    "<tenant>": "shop-1",
    "O": "payment.create",
    "K": "order-1002",
    "REF": "@reference",
    "WHEN": "24h",
    "DURATION": "15m",
    # a settlement report the docs import (written by the world)
    "settlement_detail_report_batch_118.csv": "@settlement_file",
}
# What a placeholder means in a command group's lines: (its first words) -> {placeholder: value}.
COMMAND_SUBSTITUTIONS: dict[tuple[str, ...], dict[str, str]] = {
    ("outbox",): {"ID": "@message", "<id>": "@message", "MESSAGE_ID": "@message"},
}
# Where one doc line needs another state than the same id elsewhere: (file, a piece of
# the command) -> {what the doc names: the seeded value}.
LINE_SUBSTITUTIONS: dict[tuple[str, str], dict[str, str]] = {
    # the second resolution of the walk-through meets the operation the first one settled
    ("docs/operators.md", "--as succeeded --reason x --actor bob --yes"): {
        "01a22bde-9910-7abb-82ec-b51ef341f4ee": "@failed",
    },
    # README's workflow: a void releases an authorisation, an ack clears a settled flag
    ("README.md", "ops void <id>"): {"<id>": "@authorisation"},
    ("README.md", "ops ack <id>"): {"<id>": "@flagged_succeeded"},
}
# Commands that run until stopped, and what they print once ready (stdout or stderr).
LONG_RUNNING: dict[tuple[str, ...], str] = {
    ("reconcile", "run"): "reconciler.started",
    ("sandbox", "serve"): "sandbox acquirer listening on",
    ("outbox", "relay"): "relaying every",
}
# Environment a command needs beyond the shared one.
COMMAND_ENV: dict[tuple[str, ...], dict[str, str]] = {
    ("outbox", "relay"): {"PAYORCH_OUTBOX_SINKS": "outbox_apps:sinks"},
    ("routing", "check"): {
        "PAYORCH_ROUTING": str(ROOT / "examples" / "routing.toml"),
        "PAYORCH_PROVIDERS": "routing_apps:providers",
    },
}


@dataclass(frozen=True)
class DocCommand:
    file: str  # relative to the checkout
    line: int
    text: str  # as the doc writes it, continuations joined
    expected: int | None  # the exit code the doc shows; None: 0; -1: "not 0"

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def _expected(block: list[tuple[int, str]], after: int) -> int | None:
    """The exit code the doc shows for the command ending at ``after`` in ``block``: a
    ``$ echo $?`` right after its output, else non-zero (-1) for an ``error:`` line."""
    rest = [text.strip() for number, text in block if number > after]
    output: list[str] = []
    for i, text in enumerate(rest):
        if text == "$ echo $?" and i + 1 < len(rest) and rest[i + 1].isdigit():
            return int(rest[i + 1])
        if text.startswith("$ "):
            break
        output.append(text)
    return -1 if any(text.startswith("error:") for text in output) else None


def _commands_of(path: Path) -> Iterator[DocCommand]:
    name = path.relative_to(ROOT).as_posix()
    lang: str | None = None
    block: list[tuple[int, str]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fence = FENCE.match(line)
        if fence and lang is None:
            lang, block = fence.group(2).lower(), []
            continue
        if fence:
            if lang in SHELLS:
                yield from _block_commands(name, block)
            lang = None
            continue
        if lang is not None:
            block.append((number, line))


def _block_commands(name: str, block: list[tuple[int, str]]) -> Iterator[DocCommand]:
    i = 0
    while i < len(block):
        number, line = block[i]
        text = line.strip()
        text = text[2:] if text.startswith("$ ") else text
        words = text.split()
        while words and "=" in words[0] and not words[0].startswith("-"):
            words = words[1:]  # NAME=value before the command
        if words[:1] not in (["payorch"], ["make"]):
            i += 1
            continue
        while text.endswith("\\") and i + 1 < len(block):
            i += 1
            text = text[:-1].rstrip() + " " + block[i][1].strip()
        yield DocCommand(name, number, text, _expected(block, block[i][0]))
        i += 1


def documented() -> list[DocCommand]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [command for path in docs for command in _commands_of(path)]


def readme_make_targets() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return sorted(set(re.findall(r"`make ([\w.-]+)`", text)))


COMMANDS = documented()


def test_the_docs_show_commands() -> None:
    # Guards the finder itself: if it found nothing, every test below would pass vacuously.
    files = {c.file for c in COMMANDS}
    assert {"docs/operators.md", "docs/deployment.md"} <= files
    assert any(c.text.startswith("payorch ops resolve") for c in COMMANDS)
    assert {"demo", "test"} <= set(readme_make_targets())


# -- the world the commands run in ---------------------------------------------------------


@dataclass
class World:
    template: Path  # the migrated, seeded database; each command gets a copy
    roles: dict[str, str]
    env: dict[str, str]


def seed(store: Store) -> dict[str, str]:
    """Operations of tenant shop-1 in the states the docs' commands act on."""
    tenant = "shop-1"
    unknown = to_unknown(store, claim(store, "order-1002", tenant=tenant))
    flagged = to_unknown(store, claim(store, "order-1001", tenant=tenant), attention=True)
    contradicted = store.transition(  # settled, then contradicted by a late webhook
        claim(store, "order-1003", tenant=tenant),
        State.SUCCEEDED,
        kind="provider_answer",
        actor="worker-1",
        provider_reference="sbx_doc_1003",
        response={"status": "succeeded", "http_status": 200},
        needs_attention=True,
    )
    store.append_event(
        contradicted,
        kind="conflicting_evidence",
        actor="webhook",
        detail={"outcome": "declined", "conflicts_with": "succeeded"},
    )
    failed = store.transition(
        claim(store, "order-1004", tenant=tenant),
        State.FAILED_FINAL,
        kind="operator_resolution",
        actor="alice",
        resolution="operator",
        error_code="operator_resolved",
    )
    claim(store, "order-1005", lease=timedelta(seconds=-60), possibly_sent=False, tenant=tenant)
    authorisation = to_unknown(  # an unknown authorisation: what `ops void` releases
        store,
        claim(
            store,
            "order-1006",
            tenant=tenant,
            request={"amount": 1999, "currency": "EUR", "capture_method": "manual"},
        ),
    )
    with store.engine.connect() as conn:  # the receipt the success staged (outbox_apps.hooks)
        message = str(conn.execute(sa.select(outbox.c.id).limit(1)).scalar_one())
    return {
        "message": message,
        "unknown": unknown.id,
        "flagged_unknown": flagged.id,
        "flagged_succeeded": contradicted.id,
        "failed": failed.id,
        "authorisation": authorisation.id,
        "reference": "sbx_doc_1003",
    }


def settlement_file(directory: Path) -> Path:
    """An Adyen settlement batch showing the seeded succeeded payment (``sbx_doc_1003``)."""
    entry = ReportEntry(
        entry=Entry.CAPTURE,
        reference="sbx_doc_1003",
        amount=1999,
        currency="EUR",
        created_at=datetime.now(UTC),
        merchant_reference="order-1003",
    )
    path = directory / "settlement_detail_report_batch_118.csv"
    path.write_bytes(write_adyen_settlement([entry], merchant_account="ShopECOM", batch=118))
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("docs")
    template = base / "payorch.db"
    with SandboxServer() as sandbox, StripeEmulator() as stripe:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
        env.update(
            PAYORCH_DATABASE_URL=f"sqlite:///{template}",
            PAYORCH_SANDBOX_URL=sandbox.url,
            PAYORCH_SANDBOX_WEBHOOK_SECRET=sandbox.webhook_secret,
            PAYORCH_STRIPE_API_KEY=API_KEY,
            PAYORCH_STRIPE_BASE_URL=stripe.url,
            PAYORCH_METRICS_ADDR="127.0.0.1:0",
            # the tests' own modules (sinks for `outbox relay`) importable by the commands
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "tests"), env.get("PYTHONPATH")])),
        )
        upgraded = subprocess.run(
            [str(PAYORCH), "db", "upgrade"],
            capture_output=True,
            text=True,
            env=env,
            timeout=TIMEOUT,
            check=False,
        )
        assert upgraded.returncode == 0, upgraded.stderr
        store = Store.from_url(env["PAYORCH_DATABASE_URL"], outbox_hooks=hooks)
        try:
            roles = seed(store)
        finally:
            store.close()
        roles["settlement_file"] = str(settlement_file(base))
        yield World(template=template, roles=roles, env=env)


def argv_of(command: DocCommand, roles: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command's words after substitution, and the environment it sets itself."""
    words = shlex.split(command.text, comments=True)
    if "|" in words:
        words = words[: words.index("|")]
    if words and words[-1] == "&":  # backgrounded in the reader's shell: run as any other
        words = words[:-1]
    env: dict[str, str] = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    table = dict(SUBSTITUTIONS)
    for first, extra in COMMAND_SUBSTITUTIONS.items():
        if tuple(words[1 : 1 + len(first)]) == first:
            table.update(extra)
    for (file, piece), extra in LINE_SUBSTITUTIONS.items():
        if file == command.file and piece in command.text:
            table.update(extra)

    def seeded(word: str) -> str:
        found = table.get(word, word)
        return roles[found[1:]] if found.startswith("@") else found

    return [seeded(w) for w in words], env


def long_running(words: list[str]) -> str | None:
    """What a command that runs until stopped prints once ready; None for the others."""
    ready = LONG_RUNNING.get(tuple(words[1:3]))
    if words[1:3] == ["outbox", "relay"] and "--once" in words:
        return None
    return ready


def free_ports(words: list[str]) -> list[str]:
    """The command with free ports where the doc names fixed ones (or the default)."""
    if words[1:3] == ["reconcile", "run"]:
        return [
            "127.0.0.1:0" if before in ("--metrics-addr", "--metrics") else word
            for before, word in zip(["", *words], words, strict=False)
        ]
    if words[1:3] != ["sandbox", "serve"]:
        return words
    if "--port" not in words:
        return [*words, "--port", "0"]
    at = words.index("--port") + 1
    return [*words[:at], "0", *words[at + 1 :]]


def run_until_ready(argv: list[str], env: dict[str, str], ready: str) -> tuple[int, str]:
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read(stream: IO[str]) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    readers = [
        threading.Thread(target=read, args=(s,), daemon=True) for s in (proc.stdout, proc.stderr)
    ]
    for reader in readers:
        reader.start()
    seen: list[str] = []
    ended = 0
    try:
        while ended < 2 and not any(ready in line for line in seen):
            try:
                line = lines.get(timeout=TIMEOUT)
            except queue.Empty:
                break
            if line is None:
                ended += 1
            else:
                seen.append(line)
        started = any(ready in line for line in seen)
        assert started, f"never said {ready!r}: {''.join(seen)}"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT)
    for reader in readers:
        reader.join(timeout=TIMEOUT)  # both reach EOF once the process is gone
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    while not lines.empty():
        line = lines.get()
        if line is not None:
            seen.append(line)
    return code, "".join(seen)


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_documented_command_runs(command: DocCommand, world: World, tmp_path: Path) -> None:
    words, own_env = argv_of(command, world.roles)
    if words[0] == "make":
        targets = re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
        assert words[1] in targets, f"{command}: no Makefile target {words[1]!r}"
        return
    database = tmp_path / "payorch.db"
    shutil.copyfile(world.template, database)
    env = {**world.env, "PAYORCH_DATABASE_URL": f"sqlite:///{database}", **own_env}
    env.update(COMMAND_ENV.get(tuple(words[1:3]), {}))
    argv = [str(PAYORCH), *free_ports(words)[1:]]
    ready = long_running(words)
    if ready is not None:
        code, output = run_until_ready(argv, env, ready)
    else:
        done = subprocess.run(
            argv,
            input="y\n",
            capture_output=True,
            text=True,
            env=env,
            timeout=TIMEOUT,
            check=False,
        )
        code, output = done.returncode, done.stdout + done.stderr
    assert "Traceback" not in output, f"{command}: {command.text}\n{output}"
    if command.expected == -1:
        assert code != 0, f"{command}: the doc shows a refusal; it exited 0\n{output}"
    else:
        want = command.expected or 0
        assert code == want, f"{command}: {command.text}\nexit {code}, not {want}\n{output}"


def test_readme_make_targets_exist() -> None:
    targets = re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
    for target in readme_make_targets():
        assert target in targets, f"README.md names `make {target}`, not a Makefile target"


@pytest.mark.parametrize(
    "text",
    [
        "payorch ops show ID",
        "payorch ops show --tenant T --operation O --key K",
        "payorch outbox show ID",
    ],
)
def test_the_placeholders_name_seeded_rows(text: str, world: World) -> None:
    # The substitution table stays true even while no doc uses a placeholder.
    words, _ = argv_of(DocCommand("docs/x.md", 1, text, None), world.roles)
    done = subprocess.run(
        [str(PAYORCH), *words[1:]],
        capture_output=True,
        text=True,
        env=world.env,
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert any(v in done.stdout for v in world.roles.values()), done.stdout
