"""The public surface is pinned: changing it is a deliberate act.

The surface is ``payorch.__all__`` plus the public modules below (docs/architecture.md); every
other module is ``_private``. Each public module's ``__all__`` is pinned and sorted the way
ruff sorts it, and every path the README and docs/ name (an import, a backticked
``payorch.…``) imports as written.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Any

import pytest
from public_pins import PUBLIC
from test_architecture import public_modules

import payorch
from payorch import errors

ROOT = Path(__file__).resolve().parent.parent

EXPECTED = [
    "Answer",
    "AnswerKind",
    "AsyncExecutor",
    "AsyncProvider",
    "AsyncReconciler",
    "AsyncStore",
    "AsyncWebhookHandler",
    "ClaimResult",
    "CommitUncertain",
    "ConfigurationError",
    "CorruptRecord",
    "CrossCheck",
    "DatabaseReadOnly",
    "DatabaseUnavailable",
    "DuplicatePolicy",
    "EventRecord",
    "Executor",
    "FallbackWatch",
    "HttpAnswer",
    "IdempotencyError",
    "IdempotencyKeyExpired",
    "IdempotencyKeyReused",
    "InvalidIdempotencyKey",
    "InvalidMoney",
    "InvalidRequest",
    "InvalidTenant",
    "InvalidTransition",
    "NewOperation",
    "NoRoute",
    "OperationInProgress",
    "OperationNotFound",
    "OperationRecord",
    "OperationType",
    "Outcome",
    "OutcomeNotRecorded",
    "PayorchError",
    "Provider",
    "ProviderError",
    "ProviderIdempotencyError",
    "ReconcileReport",
    "Reconciler",
    "ReconcilerDaemon",
    "ReconcilerPolicy",
    "Registry",
    "RequestBodyNotJson",
    "RequestValidationFailed",
    "RetryPolicy",
    "SchemaNotReady",
    "Settings",
    "StaleVersion",
    "State",
    "StateConflict",
    "StatusQuery",
    "StorageError",
    "Store",
    "SubmitRequest",
    "SyncStandbyUnavailable",
    "UnencodableRequest",
    "UnknownOperationType",
    "UnknownProvider",
    "WebhookEvent",
    "WebhookHandler",
    "WebhookMalformed",
    "WebhookRejected",
    "WebhookResult",
    "WebhookSignatureInvalid",
    "WebhookStatus",
    "WebhookUnstorable",
    "default_registry",
    "http_answer",
    "parse_idempotency_key",
    "parse_json_body",
    "webhook_answer",
]


def test_all_is_pinned_and_sorted() -> None:
    assert payorch.__all__ == EXPECTED
    assert sorted(payorch.__all__) == payorch.__all__
    for name in payorch.__all__:
        assert hasattr(payorch, name)


def test_every_error_derives_from_the_base_and_has_a_status() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.PayorchError)
        if cls is errors.EffectOutcomeUnknown:  # like an unknown payment: 202, ask again later
            assert cls.http_status == 202
            continue
        assert 400 <= cls.http_status <= 599


def test_every_error_has_its_own_stable_problem_type() -> None:
    types = {}
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert "problem_type" in vars(cls), f"{name} must set its own problem_type"
        assert cls.problem_type.startswith("urn:payorch:problem:")
        types[cls.problem_type] = name
    assert len(types) == len(errors.__all__)  # no two errors share a type


def test_errors_survive_pickling() -> None:
    import pickle

    exc = errors.OperationInProgress("busy", operation_id="op-1", retry_after=3.0)
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is errors.OperationInProgress
    assert (again.operation_id, again.retry_after, again.message) == ("op-1", 3.0, "busy")


# -- the public modules ------------------------------------------------------------------------


def _ruff_order(name: str) -> tuple[int, str]:
    # ruff's RUF022 ("isort-style"): CONSTANTS, then Classes, then the rest.
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    return kind, name


def test_the_pinned_modules_are_the_ones_the_architecture_lists() -> None:
    assert sorted([*PUBLIC, "payorch"]) == public_modules()


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_each_public_module_pins_a_sorted_all_that_resolves(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__all__ == PUBLIC[name]
    assert sorted(module.__all__, key=_ruff_order) == module.__all__
    for member in module.__all__:
        assert hasattr(module, member), f"{name}.{member}"


def test_the_root_sorts_as_ruff_does_too() -> None:
    assert sorted(payorch.__all__, key=_ruff_order) == payorch.__all__


# -- every path the docs name ------------------------------------------------------------------

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Names the docs give that are not import paths: span, span attribute and logger names.
TELEMETRY = frozenset(
    {
        "payorch.claim",
        "payorch.error",
        "payorch.execute",
        "payorch.executor",
        "payorch.provider.submit",
        "payorch.reconcile.check",
        "payorch.reconciler",
        "payorch.record",
        "payorch.webhook",
        "payorch.webhooks",
    }
)
# Alembic's folder in the wheel (env.py and the revisions), not a module: payorch.migrate runs it.
MIGRATIONS = "payorch.migrations"
_BACKTICKED = re.compile(r"`(payorch(?:\.\w+)+)")
_IMPORT = re.compile(r"^\s*(?:from payorch[\w.]* import |import payorch)")
_INLINE_IMPORT = re.compile(r"`((?:from payorch[\w.]* import [^`]+)|(?:import payorch[\w.]*))`")
# docs/http.md and semantics.md call the FastAPI integration's object `payorch`.
FASTAPI_OBJECT = frozenset({"endpoint", "exception_handlers", "lifespan", "operation", "router"})


def _resolve(path: str) -> Any:
    """``payorch.a.b.c``: the longest importable module, then attributes; raises if neither."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[i:]:
            value = getattr(value, attribute)
        return value
    raise ModuleNotFoundError(path)


def _imports_in(text: str) -> list[str]:
    """The payorch import statements of a text (a parenthesised one across its lines)."""
    found, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if not _IMPORT.match(line):
            continue
        statement = line.strip()
        j = i
        while "(" in statement and ")" not in statement:
            j += 1
            statement += " " + lines[j].strip()
        found.append(statement.split("#")[0].strip())
    found.extend(match.group(1).strip() for match in _INLINE_IMPORT.finditer(text))
    return found


def _documented_imports() -> list[tuple[str, str]]:
    sources = [*DOCS, *sorted((ROOT / "examples").rglob("*.py"))]
    return [
        (str(path.relative_to(ROOT)), statement)
        for path in sources
        for statement in _imports_in(path.read_text())
    ]


def test_the_docs_name_their_imports() -> None:
    # The test below reads what it should: the README's embedding example is among them.
    statements = {s for _, s in _documented_imports()}
    assert "from payorch.migrate import upgrade" in statements
    assert any(s.startswith("from payorch.integrations.fastapi import") for s in statements)


def _private(path: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in path.split("."))


@pytest.mark.parametrize(("source", "statement"), _documented_imports())
def test_every_documented_import_works(source: str, statement: str) -> None:
    node = ast.parse(statement).body[0]
    if isinstance(node, ast.Import):
        for alias in node.names:
            assert not _private(alias.name), f"{source} imports an internal module: {statement}"
            importlib.import_module(alias.name)
        return
    assert isinstance(node, ast.ImportFrom) and node.module
    module = importlib.import_module(node.module)
    for alias in node.names:
        path = f"{node.module}.{alias.name}"
        assert not _private(path), f"{source} imports an internal module: {statement}"
        assert hasattr(module, alias.name) or importlib.import_module(path), source


def _documented_paths() -> list[tuple[str, str]]:
    return sorted(
        {
            (str(path.relative_to(ROOT)), match.group(1))
            for path in DOCS
            for match in _BACKTICKED.finditer(path.read_text())
        }
    )


@pytest.mark.parametrize(("source", "path"), _documented_paths())
def test_every_backticked_path_in_the_docs_resolves(source: str, path: str) -> None:
    assert not _private(path), f"{source} names an internal module: {path}"
    if path == MIGRATIONS:
        from payorch import migrate

        assert Path(migrate.versions_directory()).is_dir()
        return
    if path in TELEMETRY:
        with pytest.raises((ModuleNotFoundError, AttributeError)):
            _resolve(path)  # a telemetry name that became a path would mislead
        return
    attribute = path.partition(".")[2]
    if attribute in FASTAPI_OBJECT:  # `payorch.router()`: the app's Payorch object
        from payorch.integrations.fastapi import Payorch

        assert hasattr(Payorch, attribute)
        return
    _resolve(path)
