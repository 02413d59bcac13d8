"""The folders tell the architecture (docs/architecture.md), and a change that breaks it fails
here: the wings import downward only, no import circle (imports inside functions count, and
type-only ones too), every internal module is marked ``_private``, no module passes 600 lines.

Read from the source (``ast``), not from ``sys.modules``: an import inside a function counts
whether or not a test happened to run it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The folders and the import root each is mapped onto (pyproject.toml).
FOLDERS = {
    "orchestrator": "payorch",
    "providers": "payorch.providers",
    "cli": "payorch.cli",
    "alembic": "payorch.migrations",
}
WINGS = ("observing", "storage", "execution", "reconciling", "integrations")
# The top of payorch: the base every wing imports ...
BASE = frozenset(
    {
        "clients",
        "core",
        "errors",
        "forks",
        "http",
        "operations",
        "outcome",
        "provider",
        "records",
        "settings",
    }
)
# ... and the public modules over the wings: migrate, and the faces (re-exports only).
FACES = frozenset({"db", "metrics", "operator", "tracing"})
OVER = FACES | {"migrate"}
# What each layer may import (besides itself).
ALLOWED: dict[str, frozenset[str]] = {
    "base": frozenset(),
    "observing": frozenset({"base"}),
    # Routing across providers: rules, health and the route record, pure over the base.
    "routing": frozenset({"base"}),
    "storage": frozenset({"base", "observing"}),
    "execution": frozenset({"base", "observing", "routing", "storage"}),
    "reconciling": frozenset({"base", "observing", "routing", "storage", "execution"}),
    "integrations": frozenset(
        {"base", "observing", "routing", "storage", "execution", "reconciling"}
    ),
    "providers": frozenset({"base", "observing"}),
    "over": frozenset({"base", "observing", "routing", "storage", "execution", "reconciling"}),
    "migrations": frozenset({"base", "observing", "storage", "over"}),
    # After the payment: the outbox and its relay, and effects done once, over the store.
    "outbox": frozenset({"base", "observing", "storage"}),
    "once": frozenset({"base", "observing", "storage"}),
    # Settlement reports as evidence: stored, then judged as the reconciler judges evidence.
    "recon": frozenset({"base", "observing", "routing", "storage", "execution", "reconciling"}),
    # The adapter kit drives an adapter through a real store, executor and webhook handler.
    "testing": frozenset(
        {"base", "observing", "routing", "storage", "execution", "reconciling", "over"}
    ),
    # A provider's emulator (payorch.providers.<name>.emulator): its adapter, for the kit.
    "emulators": frozenset({"base", "observing", "providers", "testing"}),
    "cli": frozenset(
        {
            "root",
            "base",
            "observing",
            "storage",
            "execution",
            "reconciling",
            "integrations",
            "providers",
            "over",
            "outbox",
            "once",
            "recon",
            "routing",
        }
    ),
}
MAX_LINES = 600
MAX_TOP = 16  # modules at the top of orchestrator/, __init__ included


@dataclass(frozen=True)
class Module:
    name: str  # payorch.storage._store
    path: Path
    is_package: bool

    @property
    def leaf(self) -> str:
        return self.name.rpartition(".")[2]


def _modules() -> dict[str, Module]:
    found: dict[str, Module] = {}
    for folder, root in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join([root, *parts])
            found[name] = Module(name, path, is_package)
    return found


MODULES = _modules()


def _type_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for child in node.body:
                    ids.update(id(n) for n in ast.walk(child))
    return ids


# Calls that import a module named by a string: the CLI's lazy_module, importlib's.
_BY_NAME = frozenset({"import_module", "__import__", "lazy_module"})


def _called(node: ast.Call) -> str | None:
    func = node.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)


def _by_name(node: ast.AST) -> str | None:
    """The module an import-by-name call names, when it names one by a literal string."""
    if not (isinstance(node, ast.Call) and _called(node) in _BY_NAME and node.args):
        return None
    first = node.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def _imports(module: Module, *, type_only: bool) -> Iterator[str]:
    """The payorch modules ``module`` imports, anywhere in it (functions included), by an
    import statement or by a call naming the module in a literal string."""
    tree = ast.parse(module.path.read_text())
    skip = set() if type_only else _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        named = _by_name(node)
        if named is not None and named.startswith("payorch"):
            targets = [named]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.name.split(".")
                if not module.is_package:
                    package.pop()
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module.name:
                yield target


def _graph(*, type_only: bool) -> dict[str, set[str]]:
    return {name: set(_imports(m, type_only=type_only)) for name, m in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _unreadable() -> list[str]:
    """Modules that import by a name the source does not spell out (an f-string, a variable)."""
    found = []
    for name, module in MODULES.items():
        for node in ast.walk(ast.parse(module.path.read_text())):
            if not (isinstance(node, ast.Call) and _called(node) in _BY_NAME and node.args):
                continue
            if _by_name(node) is None:
                found.append(name)
    return sorted(set(found))


def layer(name: str) -> str:
    parts = name.split(".")
    if name == "payorch":
        return "root"
    if parts[1] == "providers" and parts[-1] == "emulator":
        return "emulators"
    if parts[1] in (
        "cli",
        "providers",
        "migrations",
        "testing",
        "outbox",
        "once",
        "recon",
        "routing",
    ):
        return parts[1]
    if parts[1] in WINGS:
        return parts[1]
    if parts[1] in BASE:
        return "base"
    if parts[1] in OVER:
        return "over"
    raise AssertionError(f"{name}: a module at the top of payorch that no layer names")


@pytest.mark.parametrize("type_only", [False, True], ids=["runtime", "type-only-too"])
def test_no_import_circle(type_only: bool) -> None:
    assert _cycles(_graph(type_only=type_only)) == []


def test_benchmarks_have_no_import_circle() -> None:
    scripts = {p.stem: p for p in (ROOT / "benchmarks").glob("*.py")}
    graph: dict[str, set[str]] = {}
    for stem, path in scripts.items():
        graph[stem] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            graph[stem].update(n for n in names if n in scripts and n != stem)
    assert _cycles(graph) == []


def test_every_module_has_a_layer_and_the_layers_import_downward() -> None:
    wrong = []
    for name, targets in _graph(type_only=True).items():
        here = layer(name)
        if here == "root":
            continue
        for target in targets:
            there = layer(target)
            if there == here:
                continue
            if there not in ALLOWED[here]:
                wrong.append(f"{name} ({here}) imports {target} ({there})")
    assert wrong == []


def test_no_module_imports_a_public_face() -> None:
    # The faces re-export for users; payorch's own code imports the module behind each.
    faces = {f"payorch.{face}" for face in FACES}
    wrong = [
        f"{name} imports {target}"
        for name, targets in _graph(type_only=True).items()
        for target in targets & faces
    ]
    assert wrong == []


def test_faces_only_re_export() -> None:
    for face in sorted(FACES):
        tree = ast.parse(MODULES[f"payorch.{face}"].path.read_text())
        kinds = {type(node).__name__ for node in tree.body}
        assert kinds <= {"Expr", "ImportFrom", "Assign"}, f"payorch.{face} defines {kinds}"


def test_every_import_by_name_is_readable() -> None:
    # Only the root's lazy exports import by a computed name (its _EXPORTS table, whose
    # modules the TYPE_CHECKING block names too); anything else would hide an edge.
    assert _unreadable() == ["payorch"]


def public_modules() -> list[str]:
    """The public modules docs/architecture.md lists ("Public and internal")."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Public and internal", 1)[1].split("\n## ", 1)[0]
    return sorted(set(re.findall(r"`(payorch(?:\.[a-z]\w*)*)`", section)))


def test_every_public_name_is_a_documented_module_or_a_wing() -> None:
    # A module (or package) with no _private part in its path is public: it must be one the
    # architecture lists, or a wing package (which exports nothing), or payorch.providers.
    named = {
        name
        for name, module in MODULES.items()
        if module.leaf != "__main__"
        and not any(part.startswith("_") for part in name.split(".")[1:])
        and not name.startswith("payorch.migrations")
    }
    wings = {f"payorch.{wing}" for wing in WINGS}
    assert named == set(public_modules()) | wings | {"payorch.providers"}
    for wing in sorted(wings - {"payorch.integrations"}):
        tree = ast.parse(MODULES[wing].path.read_text())
        exported = [
            ast.unparse(node.value)
            for node in tree.body
            if isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "__all__"
            and node.value is not None
        ]
        assert exported == ["[]"], f"{wing} must export nothing"


def test_the_top_of_the_package_stays_small_and_named() -> None:
    # A base module may be a package of private parts (payorch.provider, payorch.records).
    top = sorted(
        m.leaf
        for m in MODULES.values()
        if m.name.count(".") == 1 and (not m.is_package or m.leaf in BASE)
    )
    assert top == sorted(BASE | OVER)
    assert len(top) + 1 <= MAX_TOP  # and __init__


def test_no_module_passes_600_lines() -> None:
    folders = [*FOLDERS, "tests", "benchmarks", "examples", "alembic"]
    long = {
        str(path.relative_to(ROOT)): n
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_graph_reader_sees_every_kind_of_import() -> None:
    # The checks above are only as good as this reader: it must see all four kinds.
    runtime = _graph(type_only=False)
    everything = _graph(type_only=True)
    # A function-level import (the CLI imports its commands' modules late).
    assert "payorch.cli._app" in runtime["payorch.cli"]
    # A type-only one: the root's lazy exports are imported under TYPE_CHECKING only.
    assert "payorch.storage._store" in everything["payorch"]
    assert "payorch.storage._store" not in runtime["payorch"]
    # One by name (the operator commands load their module on first use).
    assert "payorch.reconciling._operator" in runtime["payorch.cli._ops"]
    # `from .. import x` and `from . import _x as x`.
    assert "payorch.migrate" in runtime["payorch.cli._demo"]
    assert "payorch.storage._probes" in runtime["payorch.storage._store"]


def test_every_package_ships_in_the_wheel() -> None:
    # setuptools lists the packages by name: a wing missing from the list would be absent
    # from the wheel, and only an installed user would find out.
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {name for name, module in MODULES.items() if module.is_package}
    assert packages <= set(config["packages"])
