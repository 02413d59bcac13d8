"""docs/operations.md: its reference is `payorch types --markdown`, its example runs.

The reference is generated from the registry and the pydantic models; these tests fail when
a model, a registry entry or the renderer changes and the page was not regenerated, when the
command loses a type or a field, and when the page's registration example stops working.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from payorch.cli._app import app
from payorch.cli._types import BEGIN, END, describe, markdown
from payorch.core import State
from payorch.operations import default_registry
from payorch.storage._store import Store

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "operations.md"
EXAMPLE_MARK = "<!-- runnable: tests/test_operations_doc.py -->\n```python\n"
EXAMPLE_URL = 'url = "sqlite:///payments.db"\n'
runner = CliRunner()


def _invoke(*args: str) -> Result:
    return runner.invoke(app, list(args))


def _section() -> str:
    text = DOC.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{DOC.name}: one pair of markers"
    start = text.index(BEGIN)
    return text[start : text.index(END) + len(END)] + "\n"


def _by_type(section: str) -> dict[str, str]:
    """Each type's part of the reference, by name."""
    parts = section.split("\n### `")[1:]
    return {part.split("`", 1)[0]: part for part in parts}


def _one_error_line(result: Result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


# -- the reference ---------------------------------------------------------------------------


def test_the_doc_holds_exactly_what_the_command_prints() -> None:
    result = _invoke("types", "--markdown")
    assert result.exit_code == 0, result.output
    assert result.stdout == markdown(default_registry())
    assert _section() == result.stdout, (
        "docs/operations.md is out of date: run `payorch types --markdown` and paste its "
        f"output over the block from {BEGIN} to {END} (markers included)"
    )


def test_every_registered_type_and_every_field_is_in_the_doc() -> None:
    registry = default_registry()
    parts = _by_type(_section())
    assert sorted(parts) == sorted(registry.names())
    # The four money movements the contract names are among them.
    assert {"payment.create", "payment.capture", "refund.create", "payout.create"} <= set(parts)
    for name in registry.names():
        op = registry.get(name)
        part = parts[name]
        assert f"`{op.model.__module__}.{op.model.__qualname__}`" in part
        rows = {line.split(" | ")[0].removeprefix("| "): line for line in part.splitlines()}
        for field in op.model.model_fields:
            row = rows.get(f"`{field}`")
            assert row is not None, f"{name}: field {field} is missing from the reference"
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert cells[3] == ("yes" if field in op.effect_fields else "no"), row
            assert cells[4] == ("yes" if field in op.sensitive_fields else "no"), row
        fingerprint = ", ".join(f"`{f}`" for f in op.effect_fields)
        assert f"money movement): {fingerprint}." in part


def test_the_reference_reads_the_constraints_of_the_models() -> None:
    parts = _by_type(_section())
    create = parts["payment.create"]
    assert "| `amount` | integer (minor units) > 0, ≤ 10^15, strict | required |" in create
    assert "| `currency` | ISO 4217 currency code | required |" in create
    assert 'one of `automatic`, `manual` | optional, default `"automatic"`' in create
    assert "| `metadata` | object of string values | optional, default `{}` |" in create
    assert "Voidable" in create and "Voidable" not in parts["refund.create"]
    assert "ISO 4217 currency code or null | optional, default `null`" in parts["refund.create"]
    assert "Retention: 30 days" in parts["payout.create"]
    assert "answers 410" in parts["payout.create"]


def test_json_names_every_type_and_its_fields() -> None:
    result = _invoke("types", "--json")
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)["types"]
    registry = default_registry()
    assert [t["name"] for t in listed] == list(registry.names())
    for entry in listed:
        op = registry.get(entry["name"])
        assert [f["name"] for f in entry["fields"]] == list(op.model.model_fields)
        assert entry["effect_fields"] == list(op.effect_fields)
        assert [f["name"] for f in entry["fields"] if f["fingerprint"]] == [
            f for f in op.model.model_fields if f in op.effect_fields
        ]
        assert entry["retention_seconds"] == op.retention.total_seconds()
        assert entry["json_schema"] == op.model.model_json_schema()
        required = [f["name"] for f in entry["fields"] if f["required"]]
        assert required == entry["json_schema"]["required"]


def test_the_table_lists_every_type_and_field() -> None:
    result = _invoke("types")
    assert result.exit_code == 0, result.output
    registry = default_registry()
    for name in registry.names():
        assert name in result.stdout
        for field in registry.get(name).model.model_fields:
            assert field in result.stdout


# -- a registry of the app's own ---------------------------------------------------------------

APP_MODULE = """
from typing import Annotated

from pydantic import BaseModel, Field, Strict

from payorch import OperationType, default_registry


class Top_up(BaseModel):
    wallet: str = Field(max_length=40)
    amount: Annotated[int, Strict(), Field(gt=0)]
    tags: list[str] = Field(default_factory=list, description="free labels")
    pin: str | None = None


registry = default_registry("sandbox")
registry.register(
    OperationType(
        name="wallet.top_up",
        model=Top_up,
        effect_fields=("wallet", "amount"),
        sensitive_fields=("pin",),
        provider="sandbox",
    )
)


def build():
    return registry


not_a_registry = 42
"""


@pytest.fixture
def app_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "shop_registry.py").write_text(APP_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "shop_registry"
    sys.modules.pop("shop_registry", None)


def test_a_custom_type_is_listed_from_the_function_behind_the_command(app_module: str) -> None:
    import importlib

    registry = importlib.import_module(app_module).registry
    entry = {t["name"]: t for t in describe(registry)}["wallet.top_up"]
    fields = {f["name"]: f for f in entry["fields"]}
    assert list(fields) == ["wallet", "amount", "tags", "pin"]
    assert fields["wallet"]["type"] == "string of at most 40 characters"
    assert fields["amount"]["type"] == "integer (minor units) > 0, strict"
    assert fields["tags"] == {
        "name": "tags",
        "type": "list of string",
        "required": False,
        "fingerprint": False,
        "sensitive": False,
        "default": [],
        "description": "free labels",
    }
    assert fields["pin"]["sensitive"] and not fields["pin"]["fingerprint"]
    assert entry["provider"] == "sandbox"
    assert entry["retention_seconds"] == 24 * 3600
    assert entry["unknown_fields"] == "dropped"  # pydantic's default: extra keys ignored
    text = markdown(registry)
    assert "### `wallet.top_up`" in text and "Retention: 1 day after it settles" in text
    assert "Sensitive (stored as `[redacted]`): `pin`." in text


def test_a_model_json_schema_cannot_express_is_listed_by_its_python_types() -> None:
    from pydantic import BaseModel, ConfigDict

    from payorch.operations import OperationType, Registry

    class Token:  # an application class: no JSON Schema for it
        pass

    class Odd(BaseModel):
        model_config = ConfigDict(arbitrary_types_allowed=True)
        reference: str
        token: Token | None = None

    registry = Registry()
    registry.register(OperationType(name="odd.thing", model=Odd, effect_fields=("reference",)))
    (entry,) = describe(registry)
    assert [(f["name"], f["type"]) for f in entry["fields"]] == [
        ("reference", "str"),
        ("token", f"{Token.__module__}.{Token.__qualname__} | None"),
    ]
    assert "| `token` |" in markdown(registry)


@pytest.mark.parametrize("attribute", ["registry", "build"])
def test_the_command_lists_a_registry_given_by_path(app_module: str, attribute: str) -> None:
    path = f"{app_module}:{attribute}"
    listed = json.loads(_invoke("types", "--json", "--registry", path).stdout)["types"]
    names = [t["name"] for t in listed]
    assert names == sorted([*default_registry().names(), "wallet.top_up"])
    table = _invoke("types", "--registry", path)
    assert table.exit_code == 0, table.output
    assert "wallet.top_up" in table.stdout and "Provider: sandbox." in table.stdout
    text = _invoke("types", "--markdown", "--registry", f"{app_module}.{attribute}")
    assert text.exit_code == 0, text.output
    assert "| `pin` | string or null | optional, default `null` | no | yes |" in text.stdout


# -- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--json", "--markdown"], "choose one of --markdown and --json"),
        (["--registry", "no_such_module_here:registry"], "cannot load"),
        (["--registry", "shop_registry:not_a_registry"], "is not a payorch Registry"),
        (["--registry", "shop_registry:missing"], "AttributeError"),
        (["--yaml"], "No such option"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(app_module: str, args: list[str], says: str) -> None:
    line = _one_error_line(_invoke("types", *args))
    assert says in line


# -- the registration example ----------------------------------------------------------------


def _example() -> str:
    text = DOC.read_text()
    assert text.count(EXAMPLE_MARK) == 1
    code = text.split(EXAMPLE_MARK, 1)[1].split("\n```", 1)[0] + "\n"
    assert code.count(EXAMPLE_URL) == 1
    return code


def test_the_registration_example_runs(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Run on the test's database (both dialects) in a scratch directory; the rest as written.
    monkeypatch.chdir(tmp_path)
    code = _example().replace(EXAMPLE_URL, f"url = {db_url!r}\n")
    namespace: dict[str, Any] = {"__name__": "operations_doc_example"}
    # dont_inherit: this module's `from __future__ import annotations` is not the doc's.
    program = compile(code, f"{DOC}:example", "exec", dont_inherit=True)
    exec(program, namespace)  # the doc's own example, as a reader runs it
    assert capsys.readouterr().out == "succeeded True [redacted]\n"
    first, again = namespace["first"], namespace["again"]
    assert again.replayed and again.operation_id == first.operation_id
    store = Store.from_url(db_url)
    try:
        record = store.get("shop-1", first.operation_id)
    finally:
        store.close()
    assert record.state is State.SUCCEEDED
    assert record.operation == "subscription.charge"
    assert record.request["mandate_reference"] == "[redacted]"
    assert record.request["amount"] == 990 and record.request["description"] is None
    effects = namespace["acquirer"].effects_for(record.downstream_key)
    assert [(e["operation"], e["amount"], e["currency"]) for e in effects] == [
        ("subscription.charge", 990, "EUR")
    ]
    # The registry the example built is what the command lists.
    names = [t["name"] for t in describe(namespace["registry"])]
    assert "subscription.charge" in names
