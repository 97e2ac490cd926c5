"""The package's imports point one way: the layers and what each may import are written once, in
docs/architecture.md's "Layers" table, and every import in workflow/ctseg (at module level or
inside a function) is checked against it. Module-level cycles fail too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "workflow" / "ctseg"
ARCHITECTURE = REPO / "docs" / "architecture.md"
TOP = "top level"


def allowed_imports(text: str) -> dict[str, set[str]]:
    """{layer: the layers it may import}, from the table under "## Layers"."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        layer = cells[0].strip("`").removeprefix("ctseg.")
        table[layer] = {
            c.strip("`").removeprefix("ctseg.") for c in re.findall(r"`[^`]+`", cells[1])
        }
    return table


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["ctseg", *parts])


def layer_of(module: str) -> str:
    """ctseg.training.train -> training; ctseg.io -> top level; ctseg.cli -> cli."""
    parts = module.split(".")
    if len(parts) == 1:
        return TOP
    if (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return "cli" if parts[1] == "cli" else TOP


def imports_of(path: Path) -> set[str]:
    """The ctseg modules a file imports, anywhere in it (a `from ctseg.x import y` names x.y when
    y is a module of x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ctseg")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ctseg"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                as_path = PACKAGE.joinpath(*candidate.split(".")[1:])
                module = (
                    candidate
                    if as_path.with_suffix(".py").exists() or as_path.is_dir()
                    else node.module
                )
                found.add(module)
    return found


def import_graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_table_names_every_layer_of_the_package() -> None:
    table = allowed_imports(ARCHITECTURE.read_text())
    layers = {layer_of(m) for m in import_graph()}
    assert layers == set(table), "docs/architecture.md's Layers table and the package differ"


def violations(graph: dict[str, set[str]], table: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, imported in graph.items():
        here = layer_of(module)
        for target in imported:
            there = layer_of(target)
            if there != here and there not in table[here]:
                wrong.append(f"{module} ({here}) imports {target} ({there})")
    return sorted(wrong)


def test_every_import_follows_the_agreed_direction() -> None:
    table = allowed_imports(ARCHITECTURE.read_text())
    assert violations(import_graph(), table) == []


def test_a_wrong_import_is_found() -> None:
    table = allowed_imports(ARCHITECTURE.read_text())
    graph = {
        "ctseg.evaluation.metrics": {"ctseg.training.train"},
        "ctseg.report.page": {"ctseg.inference.infer"},
        "ctseg.io": {"ctseg.cli"},
    }
    assert violations(graph, table) == [
        "ctseg.evaluation.metrics (evaluation) imports ctseg.training.train (training)",
        "ctseg.io (top level) imports ctseg.cli (cli)",
        "ctseg.report.page (report) imports ctseg.inference.infer (inference)",
    ]


@pytest.mark.parametrize("layer", ["evaluation", "report", TOP])
def test_the_agreed_direction_keeps_its_promises(layer: str) -> None:
    """What docs/architecture.md promises in words: evaluation never imports training, report
    only renders (it reads the shared top level), and nothing imports cli."""
    table = allowed_imports(ARCHITECTURE.read_text())
    assert "training" not in table[layer]
    assert "cli" not in table[layer]
    assert all("cli" not in allowed for name, allowed in table.items() if name != "cli")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_round_a_circle() -> None:
    graph = {m: {t for t in imported if t != m} for m, imported in import_graph().items()}
    # A package's __init__ is not an import edge of its own modules (they import siblings).
    assert cycles(graph) == []


def test_a_circle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
