"""Every ``payorch …`` command the docs name in passing names a command the CLI has.

tests/test_docs_commands.py runs the commands of the docs' shell blocks; this reads the rest:
each inline code span that starts with ``payorch `` in README.md and docs/*.md (outside
fenced blocks; a span may wrap a line), and each indented line (a command to run) or
inline span of the examples' module docstrings that starts with ``payorch ``. Each is
checked against the CLI's own command model, in process: its command path resolves (a
group alone, ``payorch ops``, is fine), and every option it writes is an option of the
command it stands at, so a root option (``--log-format``, ``--log-level``) counts only
before the first subcommand.

Synopses are read as synopses: ``[…]`` are dropped (the options inside are still checked),
``A|B`` in a command's place is each of A and B, and between options (``[--markdown |
--json]``) it is a choice; a value after an option that takes one (``--reason …``, ``ID``,
``<id>``) is not read. What a shell makes of the rest (``> file``, ``| jq``, ``&``, ``#
comment``) is the reader's.
"""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer.main

from payorch.cli._app import app

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^\s*(```+|~~~+)")
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
SHELL_ENDS = {">", ">>", "2>", "2>&1", "&", "&&", ";", "||"}
# Spans that start with "payorch " and are not commands: (file, span) -> why.
NOT_COMMANDS: dict[tuple[str, str], str] = {
    ("docs/embedding.md", "payorch cannot start: …"): "a log message FastAPI's lifespan writes",
}
CLI: Any = typer.main.get_command(app)  # typer's own copy of click: read it duck-typed


@dataclass(frozen=True)
class Span:
    file: str  # relative to the checkout
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def _spans_in(name: str, text: str, first_line: int = 1) -> Iterator[Span]:
    for found in SPAN.finditer(text):
        body = " ".join(found.group(2).replace("\\|", "|").split())
        if body.startswith("payorch ") and (name, body) not in NOT_COMMANDS:
            yield Span(name, first_line + text.count("\n", 0, found.start()), body)


def markdown_spans(path: Path) -> Iterator[Span]:
    name = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    fenced: str | None = None
    for i, line in enumerate(lines):
        fence = FENCE.match(line)
        if fenced is None and fence:
            fenced = fence.group(1)[0]
            lines[i] = ""
        elif fenced is not None:
            if fence and fence.group(1)[0] == fenced:
                fenced = None
            lines[i] = ""  # blanked, not removed: the line numbers stay the doc's
    yield from _spans_in(name, "\n".join(lines))


def docstring_commands(path: Path) -> Iterator[Span]:
    name = path.relative_to(ROOT).as_posix()
    module = ast.parse(path.read_text(encoding="utf-8"))
    first = module.body[0] if module.body else None
    if not (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return
    doc: str = first.value.value
    for offset, line in enumerate(doc.splitlines()):
        # the indented lines are the commands to run; the summary line is prose
        if line[:1].isspace() and line.strip().startswith("payorch "):
            yield Span(name, first.lineno + offset, line.strip())
    yield from _spans_in(name, doc, first.lineno)


def documented() -> list[Span]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    spans = [span for path in docs for span in markdown_spans(path)]
    for path in sorted((ROOT / "examples").glob("*.py")):
        spans.extend(docstring_commands(path))
    return spans


# -- the checker -----------------------------------------------------------------------------


def words_of(text: str) -> list[str]:
    """The span's words, brackets dropped, up to where the shell takes over; a ``|`` between
    options stays (a choice), one outside brackets ends the command (a pipe)."""
    try:
        raw = shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote in a synopsis: its words are still readable
        raw = text.split()
    words: list[str] = []
    depth = 0
    for word in raw:
        if word in SHELL_ENDS or (word == "|" and depth == 0):
            break
        depth += word.count("[") - word.count("]")
        bare = word.strip("[]")
        if bare:
            words.append(bare)
    return words


def _options(command: Any) -> dict[str, bool]:
    """The command's option names -> whether the option takes a value."""
    names = {"--help": False}
    for param in command.params:
        if param.param_type_name == "option":
            takes = not (param.is_flag or param.count)
            names.update(dict.fromkeys([*param.opts, *param.secondary_opts], takes))
    return names


def _is_option(words: list[str]) -> bool:
    # a synopsis may list an option's name alone (`--reason --actor`): the next is checked
    return bool(words) and re.match(r"--?[A-Za-z]", words[0]) is not None


def _check(command: Any, path: list[str], words: list[str]) -> list[str]:
    where = " ".join(path)
    options = _options(command)
    subcommands: dict[str, Any] = getattr(command, "commands", {})
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if word in ("|", "…", "...") or word.endswith("…"):
            continue  # a choice between options; "and so on"
        if word.startswith("-") and len(word) > 1:
            name, given, _ = word.partition("=")
            if name not in options:
                return [f"`{where}` has no option {name}"]
            if options[name] and not given and not _is_option(words[i : i + 1]):
                i += 1  # its value, whatever the synopsis calls it
            continue
        if not subcommands:
            continue  # an argument (ID, <id>, a value the synopsis names)
        problems: list[str] = []
        for alternative in word.split("|"):
            sub = subcommands.get(alternative)
            if sub is None:
                problems.append(f"`{where}` has no command {alternative!r}")
            else:
                problems += _check(sub, [*path, alternative], words[i:])
        return problems
    return []


def problems_of(text: str) -> list[str]:
    """What is wrong with ``text`` as a payorch command line (or synopsis); [] if nothing."""
    words = words_of(text)
    if words[:1] != ["payorch"]:
        return [f"{text!r} does not start with payorch"]
    return _check(CLI, ["payorch"], words[1:])


# -- the tests -------------------------------------------------------------------------------

SPANS = documented()


def test_the_docs_name_commands_inline() -> None:
    # Guards the finder: if it found nothing, the parametrized test would pass vacuously.
    files = {span.file for span in SPANS}
    assert {"README.md", "docs/operators.md", "docs/monitoring.md"} <= files
    assert any(span.file.startswith("examples/") for span in SPANS)
    assert any("--provider-reference" in span.text for span in SPANS)  # spans in a synopsis


@pytest.mark.parametrize("span", SPANS, ids=str)
def test_inline_command_exists(span: Span) -> None:
    assert not problems_of(span.text), f"{span}: `{span.text}`: {'; '.join(problems_of(span.text))}"


@pytest.mark.parametrize(
    "text",
    [
        "payorch --log-format json reconcile run",
        "payorch --log-level debug --log-format=json reconcile once --batch 10",
        "payorch ops",
        "payorch reconcile once|run --concurrency 4",
        "payorch db upgrade|current|health",
        "payorch ops resolve ID --as succeeded|failed_final --reason … [--tenant T] [--yes]",
        "payorch types [--markdown | --json] [--registry module:attr]",
        "payorch effects unexplained --since WHEN [--adopt --actor NAME --reason TEXT [--yes]]",
        "payorch ops show ID > ticket.txt",
        "payorch ops list --json | jq .",
        "payorch ops show --help",
        "payorch ops ack <id> -y",
        "payorch ops ack ID --reason --actor [--tenant] [--yes] [--json]",
    ],
)
def test_the_checker_accepts(text: str) -> None:
    assert problems_of(text) == []


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        # the defect that started this: --log-format is the root's, not the daemon's
        ("payorch reconcile run --log-format json", "`payorch reconcile run` has no option"),
        ("payorch reconcile --log-format json run", "`payorch reconcile` has no option"),
        ("payorch ops shwo ID", "`payorch ops` has no command 'shwo'"),
        ("payorch reconcile once|forever", "has no command 'forever'"),
        ("payorch types [--markdown | --yaml]", "`payorch types` has no option --yaml"),
        ("payorch ops resolve ID [--force]", "has no option --force"),
        ("payorch --json ops list", "`payorch` has no option --json"),
        ("payorch ops ack ID --reason --force", "`payorch ops ack` has no option --force"),
    ],
)
def test_the_checker_refuses(text: str, problem: str) -> None:
    found = problems_of(text)
    assert found, f"{text!r} passed"
    assert any(problem in p for p in found), found
