"""The loss-term registry (issue 32): every term is looked up in `TERMS`, an unregistered name is
refused (never trained on as another term), and the registry, the experiment schema's
``loss.weights`` and docs/training.md's table name the same terms with the same facts."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import yaml
from conftest import REPO
from test_losses import CLIP, SHAPE, make_batch

from ctseg.io import CtsegError
from ctseg.labels import LabelSpec
from ctseg.network import losses
from ctseg.network.losses import (
    TERMS,
    LossTerm,
    compute_losses,
    level_terms,
    loss_settings,
    prepare_targets,
)
from ctseg.network.terms import OPTIONS, SPECS, TARGETS, TermSpec, check_terms, needed_targets

OPTION_VALUES = {"pos_weight": 2.0, "cldice_iterations": 2, "clip_distance": CLIP}


def schema_weight_names() -> list[str]:
    schema = yaml.safe_load((REPO / "workflow/schemas/experiment.schema.yaml").read_text())
    return list(schema["properties"]["loss"]["properties"]["weights"]["properties"])


def test_the_schema_weights_are_exactly_the_registered_terms():
    assert set(schema_weight_names()) == set(TERMS)


def test_each_entry_is_registered_under_its_own_name():
    for name, term in TERMS.items():
        assert isinstance(term, LossTerm) and term.name == name
        assert set(term.targets) <= set(TARGETS) and set(term.options) <= set(OPTIONS)
    # Every option reaches compute_losses through the loss config.
    loss_settings({"weights": {}, **OPTION_VALUES})


def test_a_term_with_an_unknown_target_or_option_cannot_be_declared():
    with pytest.raises(ValueError, match="target"):
        LossTerm("x", losses.dice_term, targets=("skeletons",))
    with pytest.raises(ValueError, match="option"):
        LossTerm("x", losses.dice_term, options=("iterations",))


def test_check_terms_takes_weights_or_names_and_answers_in_registry_order():
    assert check_terms({"boundary": 0.1, "bce": 1.0}) == ["bce", "boundary"]
    assert check_terms(["dice", "cldice"]) == ["dice", "cldice"]
    assert check_terms("skel_recall") == ["skel_recall"]
    assert check_terms({}) == []


@pytest.mark.parametrize(
    ("given", "closest"),
    [({"boundry": 1.0}, "'boundary'"), (["bce", "skel_recal"], "'skel_recall'"), ("focal", None)],
    ids=str,
)
def test_an_unregistered_term_is_refused_in_one_line(given, closest):
    with pytest.raises(CtsegError) as caught:
        check_terms(given)
    message = str(caught.value)
    assert "\n" not in message and "is not registered" in message
    assert "registered: bce, dice, cldice, skel_recall, boundary" in message
    if closest:
        assert message.endswith(f"did you mean {closest}?")
    else:
        assert message.endswith("no registered name is close")
    # compute_losses (and so the training step) refuses it the same way.
    with pytest.raises(CtsegError, match="is not registered"):
        compute_losses(torch.zeros(SHAPE), make_batch(), dict.fromkeys(check_names(given), 1.0))


def check_names(given) -> list[str]:
    return [given] if isinstance(given, str) else list(given)


def level_inputs(seed: int = 5):
    batch = make_batch()
    logits = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
    t = prepare_targets(batch, logits.shape, list(TARGETS))
    return batch, logits, t


def test_an_unregistered_name_is_not_computed_as_the_boundary_term():
    """The if/elif dispatch this replaced sent every name it did not know to the boundary loss."""
    _, logits, t = level_inputs()
    with pytest.raises(CtsegError, match="'surface' is not registered"):
        level_terms(logits, t, ["dice", "surface"], **OPTION_VALUES)


def test_a_registered_toy_term_is_dispatched_with_its_input_targets_and_options(monkeypatch):
    seen = {}

    def toy_term(x: torch.Tensor, t: dict[str, torch.Tensor], d: float, n: int) -> torch.Tensor:
        seen.update(x=x, d=d, n=n, keys=set(t))
        return (x * t["tube"]).sum() / d + n

    # A term is registered twice over: what it needs (its spec, which planning checks) and
    # its function (the registry the step calls).
    needs = {"targets": ("tube",), "options": ("clip_distance", "cldice_iterations")}
    monkeypatch.setitem(SPECS, "toy", TermSpec("toy", **needs))
    monkeypatch.setitem(TERMS, "toy", LossTerm("toy", toy_term, **needs))
    assert check_terms({"toy": 1.0}) == ["toy"]
    assert needed_targets(["bce", "toy"]) == ["tube"]
    batch, logits, t = level_inputs()
    out = level_terms(logits, t, ["toy"], **OPTION_VALUES)
    assert seen["d"] == CLIP and seen["n"] == 2 and {"valid", "target", "tube"} <= seen["keys"]
    p = torch.where(t["valid"] > 0, torch.sigmoid(logits), 0.0)
    torch.testing.assert_close(seen["x"], p)  # not on_logits: the masked probability
    torch.testing.assert_close(out["toy"], (p * t["tube"]).sum() / CLIP + 2)
    # Through compute_losses: its targets are prepared from the batch, and it is weighted.
    total, terms = compute_losses(logits, batch, {"toy": 3.0, "dice": 1.0}, clip_distance=CLIP)
    assert list(terms) == ["dice", "toy"]
    torch.testing.assert_close(total, 3.0 * terms["toy"] + terms["dice"])
    with pytest.raises(KeyError, match="tube"):
        compute_losses(logits, {"label": batch["label"]}, {"toy": 1.0}, clip_distance=CLIP)


def test_on_logits_terms_get_the_masked_logits():
    _, logits, t = level_inputs()
    seen = {}
    term = LossTerm("raw", lambda x, t: seen.setdefault("x", x).sum(), on_logits=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(TERMS, "raw", term)
        level_terms(logits, t, ["raw"], **OPTION_VALUES)
    torch.testing.assert_close(seen["x"], torch.where(t["valid"] > 0, logits, 0.0))


def test_needed_targets_come_from_the_registry():
    assert needed_targets([]) == needed_targets(["bce", "dice"]) == []
    assert needed_targets(["boundary", "cldice"]) == ["skeleton", "sdt"]
    assert needed_targets(TERMS) == ["skeleton", "tube", "sdt"]
    with pytest.raises(CtsegError, match="is not registered"):
        needed_targets(["dice", "tube"])


def test_the_registered_dispatch_compiles_to_one_graph():
    """`Run.compile_step` compiles the losses as a region of their own: the registry lookup
    must trace without a graph break (dynamo's eager backend: the same capture, no codegen)."""
    batch = make_batch()
    weights = dict.fromkeys(TERMS, 1.0)
    fn = functools.partial(compute_losses, weights=weights, pos_weight=2.0, clip_distance=CLIP)
    logits = [
        torch.randn(SHAPE, generator=torch.Generator().manual_seed(3)).requires_grad_(),
        torch.randn((2, 1, 8, 10, 10), generator=torch.Generator().manual_seed(4)),
    ]
    logits[1].requires_grad_()
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(fn)(logits, batch)
        assert explained.graph_count == 1 and explained.graph_break_count == 0
        total, terms = torch.compile(fn, backend="eager", fullgraph=True)(logits, batch)
    finally:
        torch._dynamo.reset()
    ref_total, ref_terms = fn(logits, batch)
    torch.testing.assert_close(total, ref_total)
    assert terms.keys() == ref_terms.keys() == TERMS.keys()
    for a, b in zip(
        torch.autograd.grad(total, logits), torch.autograd.grad(ref_total, logits), strict=True
    ):
        torch.testing.assert_close(a, b)


def test_the_label_convention_comes_from_the_spec():
    """Foreground and ignored voxels are the spec's (`ctseg.labels`), not literal 1 and 2: the same
    batch relabelled under another spec gives bit-identical terms and gradients."""
    batch = make_batch()
    other = LabelSpec(labels={"background": 0, "sheet": 3}, ignore=7)
    label = batch["label"]
    relabelled = {**batch, "label": torch.where(label == 1, 3, torch.where(label == 2, 7, label))}
    del batch["ignore"], relabelled["ignore"]  # the label alone marks the unlabelled slab
    weights = dict.fromkeys(TERMS, 1.0)
    results = []
    for b, spec in ((batch, None), (relabelled, other)):
        logits = torch.randn(SHAPE, generator=torch.Generator().manual_seed(6)).requires_grad_()
        kwargs = {"labels": spec} if spec else {}
        total, terms = compute_losses(logits, b, weights, clip_distance=CLIP, **kwargs)
        results.append((total, terms, torch.autograd.grad(total, logits)[0]))
    (ta, terms_a, ga), (tb, terms_b, gb) = results
    assert torch.equal(ta, tb) and torch.equal(ga, gb)
    assert all(torch.equal(terms_a[k], terms_b[k]) for k in TERMS)


# -- docs/training.md ---------------------------------------------------------------------------


def docs_table() -> dict[str, dict[str, list[str]]]:
    """docs/training.md's "Loss terms" table: term -> {targets, options} as backticked names."""
    text = (REPO / "docs/training.md").read_text()
    section = text.split("\n## Loss terms\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 4, line
        name = re.fullmatch(r"`(\w+)`", cells[0]).group(1)
        ticked = lambda cell: re.findall(r"`(\w+)`", cell)  # noqa: E731
        rows[name] = {"targets": ticked(cells[2]), "options": ticked(cells[3])}
    return rows


def test_the_docs_list_every_term_with_its_targets_and_options():
    table = docs_table()
    assert list(table) == list(TERMS)
    for name, term in TERMS.items():
        assert table[name] == {"targets": list(term.targets), "options": list(term.options)}, name


def test_every_spec_has_its_function_and_planning_needs_no_torch() -> None:
    """`ctseg.network.terms` holds what each term needs, without torch (planning imports it
    as the workflow loads); the registry gives each spec its function, term for term."""
    import subprocess
    import sys

    assert list(TERMS) == list(SPECS)
    for name, term in TERMS.items():
        spec = SPECS[name]
        assert (term.targets, term.options, term.on_logits, term.binary_only) == (
            spec.targets,
            spec.options,
            spec.on_logits,
            spec.binary_only,
        )
    probe = (
        "import sys; import ctseg.network.terms, ctseg.planning.build; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
