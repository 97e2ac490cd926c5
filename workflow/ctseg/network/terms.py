"""The loss terms' names and what each needs, without torch: planning checks an experiment's
terms (`check_terms`) and the loader asks which targets they need (`needed_targets`) without
importing the losses. `ctseg.network.losses.TERMS` gives each of these specs its function.
docs/training.md lists the terms."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ctseg.io import CtsegError
from ctseg.labels import KAGGLE, LabelSpec

# The targets `prepare_targets` can add beyond ``valid`` and ``target``, each from the batch
# entry of the same name, and the options `level_terms` can hand a term.
TARGETS = ("skeleton", "tube", "sdt")
OPTIONS = ("pos_weight", "cldice_iterations", "clip_distance")


@dataclass(frozen=True)
class TermSpec:
    """What one loss term reads: its targets (of TARGETS), its options (of OPTIONS), whether it
    takes the logits rather than the probability, and whether it is for one class only."""

    name: str
    targets: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    on_logits: bool = False
    binary_only: bool = False

    def __post_init__(self) -> None:
        for kind, given, known in (
            ("target", self.targets, TARGETS),
            ("option", self.options, OPTIONS),
        ):
            unknown = [x for x in given if x not in known]
            if unknown:
                raise ValueError(f"loss term {self.name!r}: {kind}(s) {unknown}; known: {known}")


# The order is the order of the terms in steps.csv.
SPECS: dict[str, TermSpec] = {
    spec.name: spec
    for spec in (
        TermSpec("bce", options=("pos_weight",), on_logits=True, binary_only=True),
        TermSpec("dice"),
        TermSpec("cldice", targets=("skeleton",), options=("cldice_iterations",), binary_only=True),
        TermSpec("skel_recall", targets=("tube",), binary_only=True),
        TermSpec("boundary", targets=("sdt",), options=("clip_distance",), binary_only=True),
        TermSpec("ce", on_logits=True),
    )
}


def unregistered(name: object) -> str:
    """The one line refusing `name`: the registered names and the closest of them."""
    registered = list(SPECS)
    close = difflib.get_close_matches(str(name), registered, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "; no registered name is close"
    return f"loss term {name!r} is not registered; registered: {', '.join(registered)}{hint}"


def binary_only(name: str, labels: LabelSpec) -> str:
    """The one line refusing a binary-only term `name` for the multi-class spec `labels`."""
    binary = ", ".join(n for n, term in SPECS.items() if term.binary_only)
    multi = ", ".join(n for n, term in SPECS.items() if not term.binary_only)
    return (
        f"loss term {name!r} is for one foreground class ({binary}); {labels.source} has "
        f"{labels.n_classes} ({', '.join(labels.classes)}): use {multi} (set {name} to 0)"
    )


def check_terms(
    weights_or_names: Mapping[str, Any] | Iterable[str] | str, labels: LabelSpec = KAGGLE
) -> list[str]:
    """The names (a weights mapping's keys, or names) in registry order; raises CtsegError with
    `unregistered`'s line for the first one that is not in `SPECS`, and for a multi-class
    `labels` with `binary_only`'s line for the first binary-only one. For planning: a misspelt,
    unregistered or unsuitable term stops the workflow before any job starts. A mapping's
    terms of weight 0 are not checked against `labels` (they are never computed)."""
    names = [weights_or_names] if isinstance(weights_or_names, str) else list(weights_or_names)
    for name in names:
        if name not in SPECS:
            raise CtsegError(unregistered(name))
    if not labels.is_binary:
        used = names
        if isinstance(weights_or_names, Mapping):
            used = [n for n in names if not _is_zero(weights_or_names[n])]
        for name in used:
            if SPECS[name].binary_only:
                raise CtsegError(binary_only(name, labels))
    return [name for name in SPECS if name in names]


def _is_zero(weight: Any) -> bool:
    return isinstance(weight, int | float) and not isinstance(weight, bool) and weight == 0


def needed_targets(names: Iterable[str]) -> list[str]:
    """The batch entries beyond label and ignore that the named terms need, in TARGETS order."""
    wanted = {target for name in check_terms(names) for target in SPECS[name].targets}
    return [target for target in TARGETS if target in wanted]
