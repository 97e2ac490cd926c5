"""No module but ctseg.labels spells label values as literals.

The label convention (which value is background, which foreground, which ignored) has one owner,
ctseg.labels (`LabelSpec`); code asks a spec (`spec.foreground(label)`, `spec.ignored(label)`,
`spec.valid_values`) so that a dataset.yaml with other values reaches every stage. This test reads
the package's source (ast) and fails on:

* a comparison whose one side is label-valued and whose other side is an int literal, or a
  tuple/list/set of them: ``label == 1``, ``batch["label"] != 2``, ``gt.max() > 2``,
  ``value in (0, 1, 2)``;
* a name that says label bound to an int literal or a collection of them (``IGNORE_LABEL = 2``,
  ``LABEL_VALUES = (0, 1, 2)``), the way such literals hide behind a constant.

"Label-valued" is an expression whose name (a variable, an attribute, a subscript's string key,
or the object a method is called on) is a label word: it contains ``label`` or one of its
``_``-separated parts is ``gt``, ``truth``, ``lab``, ``target`` or ``y``... (`LABEL_WORDS`), except
metadata of the array (``label.shape``, ``label.size``, ``len(labels)``) and counts
(``n_labels``, ``LABELLED_TRIES``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "workflow" / "ctseg"
OWNER = "labels.py"

# Files that compare label values with literals but belong to other work in progress: each must
# switch to ctseg.labels and leave this list (issue 32). A listed file without a finding fails too.
NOT_YET_CONVERTED: frozenset[str] = frozenset()

LABEL_PARTS = {"gt", "truth", "lab", "labs", "y_true", "ground"}
NOT_LABEL = re.compile(r"^(n|num|count|max|min)_|_(count|counts|fraction|shape|path|dir)$|unlabel")
# Attributes and methods that give the array's metadata or a count, not label values.
METADATA = {
    "shape",
    "size",
    "ndim",
    "dtype",
    "itemsize",
    "nbytes",
    "numel",
    "dim",
    "sum",
    "count",
    "nonzero",
    "count_nonzero",
    "mean",
    "__len__",
}


# int(label.max()) and float(gt[0]) still read label values.
VALUE_CASTS = {"int", "float"}
COUNT_PARTS = {"n", "num", "count", "counts", "max", "min", "shown", "tries", "limit", "size"}


def label_word(name: str) -> bool:
    low = name.lower()
    if NOT_LABEL.search(low):
        return False
    return "label" in low or bool(LABEL_PARTS & set(low.split("_")))


def label_valued(node: ast.expr) -> bool:
    """Whether `node` reads label values: a label word as a name, an attribute, a subscript key
    or the receiver of a method call (but not its shape, size or a count of it)."""
    if isinstance(node, ast.Name):
        return label_word(node.id)
    if isinstance(node, ast.Attribute):
        return node.attr not in METADATA and (label_word(node.attr) or label_valued(node.value))
    if isinstance(node, ast.Subscript):
        key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and label_word(key.value):
            return True
        return label_valued(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr not in METADATA and label_valued(node.func.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1:
        return node.func.id in VALUE_CASTS and label_valued(node.args[0])
    return False


def label_constant(name: str) -> bool:
    """A name for label values: a part `label`/`labels` (IGNORE_LABEL, LABEL_VALUES), not a
    count or a limit (LABELLED_TRIES, MAX_LABELS_SHOWN)."""
    parts = set(name.lower().split("_"))
    return bool(parts & {"label", "labels"}) and not parts & COUNT_PARTS


def int_literal(node: ast.expr) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        node = node.operand
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int) and not isinstance(node.value, bool)
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return bool(node.elts) and all(int_literal(e) for e in node.elts)
    return False


def findings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for a, b in zip(sides, sides[1:], strict=False):
                if (label_valued(a) and int_literal(b)) or (label_valued(b) and int_literal(a)):
                    yield node.lineno, ast.unparse(node)
                    break
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            for target in targets:
                if (
                    isinstance(target, ast.Name)
                    and label_constant(target.id)
                    and value is not None
                    and int_literal(value)
                ):
                    yield node.lineno, ast.unparse(node)


def package_findings() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == OWNER:
            continue
        hits = [f"{rel}:{line}: {text}" for line, text in findings(ast.parse(path.read_text()))]
        if hits:
            found[rel] = hits
    return found


def test_no_label_literals_outside_labels_py():
    found = package_findings()
    offending = [hit for rel, hits in found.items() if rel not in NOT_YET_CONVERTED for hit in hits]
    assert not offending, (
        "label values as literals; ask a ctseg.labels.LabelSpec instead "
        "(spec.foreground(label), spec.ignored(label), spec.valid_values):\n" + "\n".join(offending)
    )


def test_allow_list_is_current():
    """A file that no longer compares label literals leaves NOT_YET_CONVERTED."""
    stale = sorted(rel for rel in NOT_YET_CONVERTED if rel not in package_findings())
    assert not stale, f"remove from NOT_YET_CONVERTED, they are clean now: {stale}"


def check(source: str) -> list[str]:
    return [text for _, text in findings(ast.parse(source))]


def test_rule_catches_the_forms():
    assert check("label == 1") == ["label == 1"]
    assert check("x = batch['label'] != 2")
    assert check("gt != 2")
    assert check("2 == lab")
    assert check("label.max() > 2")
    assert check("label[inner] == 2")
    assert check("truth_mask = gt_vol == 1")
    assert check("v in (0, 1, 2) or label in (0, 1)")
    assert check("IGNORE_LABEL = 2")
    assert check("LABEL_VALUES = (0, 1, 2)")
    assert check("self.label == 1")
    assert check("int(label.max()) > 2")
    assert check("IGNORE_LABEL: int = 2")


def test_rule_leaves_counts_and_shapes():
    for ok in (
        "label.size == 0",
        "label.ndim == 3",
        "len(labels) > 1",
        "label.shape[0] == 1",
        "n_labels == 0",
        "labels.sum() > 0",
        "label == spec.ignore",
        "pred != 0",
        "ignore == 0",
        "x = 'label'",
        "label_count == 2",
        "MAX_LABELS_SHOWN = 10",
        "LABELLED_TRIES = 16",
        "len(label) == 2",
    ):
        assert not check(ok), ok
