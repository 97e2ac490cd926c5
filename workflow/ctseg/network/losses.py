"""Loss terms for sheet segmentation, each restricted to the labelled voxels.

Inputs: ``logits`` (B, C, Z, Y, X) and a batch dict on the same device with
``label`` (values as a `ctseg.labels.LabelSpec` says; `KAGGLE` by default: 0 background,
1 sheet, 2 unlabelled), ``ignore`` (1 = not labelled), and the offline
targets ``skeleton``, ``tube`` (0/1) and ``sdt`` (signed distance to the sheet in voxels,
positive outside, negative inside, clipped to [-d, d]). Each may be (B, 1, ...) or (B, ...).

Conventions shared by every term:
- The valid mask is ``ignore == 0`` (and not ``labels.ignored(label)``, label 2 for Kaggle, so
  an unlabelled voxel can never be taken for background). The binary target is
  ``labels.foreground(label)`` (label 1 for Kaggle).
- The prediction is p = sigmoid(logits) on valid voxels and **0 on ignored ones**, as the
  competition metric zeroes the prediction where GT == 2. Every term is a function of this
  masked p and of masked targets only, so logits inside the ignore region change no term and
  receive zero gradient; this matters for clDice, whose pooling would otherwise reach across.
- Sums run over the whole batch (batch Dice, as nnU-Net's ``batch_dice``): a patch without
  sheet voxels then does not produce a Dice of 0 against a near-empty prediction.
- Ratios use ``SMOOTH`` = 1 in numerator and denominator (the clDice and Skeleton Recall
  reference implementations do the same). An all-ignore batch therefore gives 0 for every
  term, with zero (finite) gradients.
- Reductions are in float32 with autocast disabled, so bf16/fp16 logits are safe.

A binary spec (one foreground class) has C = 1 output channel and p = sigmoid(logits). A
multi-class spec (K >= 2 classes) has C = K+1 channels, background first, and p = softmax over
them; its targets add ``classes``, one channel per class (`prepare_targets`), and only ``ce``
and ``dice`` apply (`check_terms` refuses the binary-only terms in one line).

Terms (all are minimised by the perfect prediction p = (label == 1) on valid voxels):
- ``bce``: BCEWithLogits with ``pos_weight``, mean over valid voxels; minimum 0. Binary only.
- ``dice``: 1 - (2 sum(p t) + s) / (sum(p) + sum(t) + s); minimum 0. Multi-class: the mean of
  that over the classes 1..K, each class's channel of the softmax against its own target.
- ``ce``: cross-entropy, mean over valid voxels: softmax over the K+1 channels (multi-class);
  binary: the two-class cross-entropy of the sigmoid, ``bce`` with pos_weight 1. Minimum 0.
- ``cldice``: clDice (Shit et al. 2021) between the soft skeleton of p and the precomputed GT
  skeleton; minimum 0. Binary only, as are ``skel_recall`` and ``boundary``.
- ``skel_recall``: Skeleton Recall (Kirchhoff et al. 2024), 1 - soft recall of p on the tube;
  the paper's loss is -recall, shifted here by 1 so that perfect = 0; minimum 0.
- ``boundary``: boundary loss (Kervadec et al.), mean over valid voxels of p * sdt / d. Its
  minimum is **negative**: mean(min(sdt, 0)) / d over valid voxels, reached by the perfect
  prediction (p = 1 where sdt < 0, p = 0 where sdt > 0). Kervadec et al. use it next to a
  region loss (Dice), not alone.

Every term is registered in `TERMS` (name -> `LossTerm`: its function, the targets it needs from
`prepare_targets`, the options it reads); `level_terms` dispatches there and nowhere else, and
`check_terms` refuses a name that is not registered (the workflow calls it at planning).
docs/training.md lists the terms; tests/test_loss_registry.py keeps the registry, the schema's
``loss.weights`` and that list equal.

Deep supervision (a list of logits [full, 1/2, 1/4, ...] from `ctseg.network.model.UNet3D`): level
k's
targets come from the full-resolution ones with 2**k x 2**k x 2**k cells (ceil-mode, matching
the model's far-end padding; a multi-class spec's by the cell's first voxel, nearest), see
`downsample_targets`. Level weights default to 1, 1/2, 1/4, ...
normalised to sum 1 (nnU-Net's halving; nnU-Net also zeroes the lowest level, which our model
has no head for anyway). The total is sum_k w_k total_k, and each **logged term is the same
level-weighted sum** sum_k w_k term_k, so total == sum_name weight_name * terms[name] always
holds. Without deep supervision the terms are simply the full-resolution ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ctseg.io import CtsegError
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.network.terms import SPECS, TermSpec, check_terms, needed_targets, unregistered

SMOOTH = 1.0


# -- targets ------------------------------------------------------------------------------------


def _as_5d(name: str, value: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if value.ndim == len(shape) - 1:
        value = value.unsqueeze(1)
    if value.shape != shape:
        raise CtsegError(f"batch[{name!r}] has shape {tuple(value.shape)}; logits {tuple(shape)}")
    return value


def prepare_targets(
    batch: Mapping[str, torch.Tensor],
    shape: torch.Size,
    needed: Sequence[str] = (),
    labels: LabelSpec = KAGGLE,
) -> dict[str, torch.Tensor]:
    """Float32 targets at full resolution, all zeroed outside the valid mask (`labels` says
    which label values are ignored and which are the foreground).

    Returns ``valid`` and ``target`` (0/1), plus ``skeleton`` and ``tube`` (restricted to the
    target: the Skeleton Recall reference multiplies its tube by the GT, and a skeleton lies in
    the foreground by definition) and ``sdt`` (in voxels; `boundary_term` clamps it to [-d, d],
    which also tames an inf from an all-foreground block) when needed.
    """
    for key in ("label", *needed):
        if key not in batch:
            raise KeyError(f"batch has no {key!r} (needed by the configured loss terms)")
    label = _as_5d("label", batch["label"], shape)
    valid = ~labels.ignored(label)
    if "ignore" in batch:
        valid = valid & (_as_5d("ignore", batch["ignore"], shape) == 0)
    target = labels.foreground(label) & valid
    out = {"valid": valid.float(), "target": target.float()}
    if not labels.is_binary:
        # One channel per class, background first (the network's softmax channels), 0 where
        # not valid.
        values = (labels.background, *labels.foreground_values)
        out["classes"] = torch.cat([(label == v) & valid for v in values], dim=1).float()
    for key in ("skeleton", "tube"):
        if key in needed:
            out[key] = ((_as_5d(key, batch[key], shape) != 0) & target).float()
    if "sdt" in needed:
        out["sdt"] = torch.where(valid, _as_5d("sdt", batch["sdt"], shape).float(), 0.0)
    return out


def _pool_max(x: torch.Tensor, factor: int) -> torch.Tensor:
    return F.max_pool3d(x, factor, stride=factor, ceil_mode=True)


def downsample_targets(targets: Mapping[str, torch.Tensor], factor: int) -> dict[str, torch.Tensor]:
    """Targets for a 1/factor output, one coarse voxel per factor**3 cell.

    - ``target``, ``skeleton``, ``tube``: max over the cell, so a 1-2 voxel sheet survives.
    - ``valid``: a cell is valid when its max is known: it holds a labelled sheet voxel (the
      max is 1 whatever the unlabelled ones are) or has no unlabelled voxel at all.
    - ``sdt``: min over the cell (still in full-resolution voxels, still divided by the same d),
      so sdt < 0 exactly where the coarse target is 1; averaging would cancel a 2-voxel sheet
      against its surroundings.
    """
    if factor == 1:
        return dict(targets)
    if "classes" in targets:
        # Multi-class: the cell's first voxel (nearest), so each coarse voxel keeps one class.
        return {k: v[..., ::factor, ::factor, ::factor] for k, v in targets.items()}
    out = {k: _pool_max(v, factor) for k, v in targets.items() if k not in ("valid", "sdt")}
    all_valid = -_pool_max(-targets["valid"], factor)
    out["valid"] = torch.maximum(out["target"], all_valid)
    if "sdt" in targets:
        # Ignored voxels hold 0 in the masked sdt; give them +inf so they cannot win the min.
        sdt = torch.where(targets["valid"] > 0, targets["sdt"], torch.inf)
        sdt = -_pool_max(-sdt, factor)
        out["sdt"] = torch.where(out["valid"] > 0, sdt, 0.0)
    return out


# -- soft skeleton (Shit et al. 2021, reference implementation) ---------------------------------


def soft_erode(x: torch.Tensor) -> torch.Tensor:
    """Min-pool with a 3D cross: the minimum of three 1D min-pools along z, y and x."""
    p1 = -F.max_pool3d(-x, (3, 1, 1), stride=1, padding=(1, 0, 0))
    p2 = -F.max_pool3d(-x, (1, 3, 1), stride=1, padding=(0, 1, 0))
    p3 = -F.max_pool3d(-x, (1, 1, 3), stride=1, padding=(0, 0, 1))
    return torch.minimum(torch.minimum(p1, p2), p3)


def soft_dilate(x: torch.Tensor) -> torch.Tensor:
    return F.max_pool3d(x, 3, stride=1, padding=1)


def soft_open(x: torch.Tensor) -> torch.Tensor:
    return soft_dilate(soft_erode(x))


def soft_skeleton(x: torch.Tensor, iterations: int = 3) -> torch.Tensor:
    """Soft morphological skeleton of a (B, C, Z, Y, X) map in [0, 1]."""
    skel = F.relu(x - soft_open(x))
    for _ in range(iterations):
        x = soft_erode(x)
        delta = F.relu(x - soft_open(x))
        skel = skel + F.relu(delta - skel * delta)
    return skel


# -- terms --------------------------------------------------------------------------------------


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return (num + SMOOTH) / (den + SMOOTH)


def bce_term(logits: torch.Tensor, t: dict[str, torch.Tensor], pos_weight: float) -> torch.Tensor:
    """``logits`` are float32 and already zeroed on ignored voxels.

    BCEWithLogits with ``pos_weight`` written out, pos_weight * t * softplus(-x) +
    (1 - t) * softplus(x): the same loss as ``F.binary_cross_entropy_with_logits`` (a test keeps
    them equal), in element-wise ops that keep the logits' memory format, with pos_weight a
    Python number rather than a tensor copied to the device on every call."""
    target = t["target"]
    loss = pos_weight * target * F.softplus(-logits) + (1.0 - target) * F.softplus(logits)
    return (loss * t["valid"]).sum() / t["valid"].sum().clamp_min(1.0)


def ce_term(logits: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy, mean over valid voxels: softmax over the K+1 channels (multi-class), or
    the two-class cross-entropy of one sigmoid channel (binary: ``bce`` with pos_weight 1)."""
    if "classes" not in t:
        return bce_term(logits, t, 1.0)
    loss = -(t["classes"] * F.log_softmax(logits, dim=1)).sum(dim=1, keepdim=True)
    return (loss * t["valid"]).sum() / t["valid"].sum().clamp_min(1.0)


def dice_term(p: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Soft Dice loss of the sheet (binary), or the mean over the foreground classes 1..K of
    each class's soft Dice loss on the softmax (multi-class); batch sums either way."""
    if "classes" in t:
        dims = (0, *range(2, p.ndim))
        target = t["classes"][:, 1:]
        fg = p[:, 1:]
        ratio = _ratio(2.0 * (fg * target).sum(dims), fg.sum(dims) + target.sum(dims))
        return 1.0 - ratio.mean()
    target = t["target"]
    return 1.0 - _ratio(2.0 * (p * target).sum(), p.sum() + target.sum())


def cldice_term(p: torch.Tensor, t: dict[str, torch.Tensor], iterations: int) -> torch.Tensor:
    # p is 0 on ignored voxels, so its skeleton never sees the network's output there, and is
    # itself 0 there (x - open(x) <= 0 where x = 0).
    skel_pred = soft_skeleton(p, iterations)
    tprec = _ratio((skel_pred * t["target"]).sum(), skel_pred.sum())
    tsens = _ratio((t["skeleton"] * p).sum(), t["skeleton"].sum())
    return 1.0 - 2.0 * tprec * tsens / (tprec + tsens)


def skel_recall_term(p: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    return 1.0 - _ratio((p * t["tube"]).sum(), t["tube"].sum())


def boundary_term(
    p: torch.Tensor, t: dict[str, torch.Tensor], clip_distance: float
) -> torch.Tensor:
    sdt = t["sdt"].clamp(-clip_distance, clip_distance) / clip_distance
    return (p * sdt).sum() / t["valid"].sum().clamp_min(1.0)


def boundary_minimum(
    batch: Mapping[str, torch.Tensor], clip_distance: float, labels: LabelSpec = KAGGLE
) -> torch.Tensor:
    """The documented minimum of ``boundary``: mean(min(sdt, 0)) / d over valid voxels."""
    label = batch["label"]
    shape = label.shape if label.ndim == 5 else label.unsqueeze(1).shape
    t = prepare_targets(batch, shape, ["sdt"], labels)
    sdt = t["sdt"].clamp(-clip_distance, clip_distance) / clip_distance
    return sdt.clamp_max(0.0).sum() / t["valid"].sum().clamp_min(1.0)


# -- registry -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossTerm:
    """One loss term: ``function(x, t, *options)`` with x the masked float32 logits
    (``on_logits``) or the masked probability p, t the level's targets (``valid``, ``target`` and
    the named ``targets``), then the values of the ``options`` it reads, in that order, as
    `compute_losses` was given them. What a term needs is its `ctseg.network.terms.TermSpec`'s."""

    name: str
    function: Callable[..., torch.Tensor]
    targets: tuple[str, ...] = ()  # batch entries beyond label and ignore (`prepare_targets`)
    options: tuple[str, ...] = ()  # of OPTIONS
    on_logits: bool = False
    binary_only: bool = False  # refused for a multi-class spec (`check_terms`)

    def __post_init__(self) -> None:
        TermSpec(self.name, self.targets, self.options, self.on_logits, self.binary_only)


FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "bce": bce_term,
    "dice": dice_term,
    "cldice": cldice_term,
    "skel_recall": skel_recall_term,
    "boundary": boundary_term,
    "ce": ce_term,
}
# A plain dict of plain Python functions: torch.compile (`Run.compile_step`) traces the lookup
# as a constant. Each term's needs are its spec's (`ctseg.network.terms.SPECS`, whose order is
# the order of the terms in steps.csv).
TERMS: dict[str, LossTerm] = {
    name: LossTerm(
        name, FUNCTIONS[name], spec.targets, spec.options, spec.on_logits, spec.binary_only
    )
    for name, spec in SPECS.items()
}


def level_terms(
    logits: torch.Tensor,
    t: dict[str, torch.Tensor],
    names: Sequence[str],
    *,
    pos_weight: float,
    cldice_iterations: int,
    clip_distance: float,
) -> dict[str, torch.Tensor]:
    """The named terms for one output and its (already downsampled) targets."""
    valid = t["valid"] > 0
    # Masking the logits before the sigmoid keeps even NaN or inf in the ignore region from
    # reaching a term or a gradient (0 * NaN is NaN in backward, a zeroed input is not).
    logits = torch.where(valid, logits.float(), 0.0)
    if "classes" in t:  # multi-class: softmax over the K+1 channels
        p = torch.where(valid, torch.softmax(logits, dim=1), 0.0)
    else:
        p = torch.where(valid, torch.sigmoid(logits), 0.0)
    options = {
        "pos_weight": pos_weight,
        "cldice_iterations": cldice_iterations,
        "clip_distance": clip_distance,
    }
    out = {}
    for name in names:
        if name not in TERMS:
            raise CtsegError(unregistered(name))
        term = TERMS[name]
        values = [options[key] for key in term.options]
        out[name] = term.function(logits if term.on_logits else p, t, *values)
    return out


def deep_supervision_weights(n_levels: int) -> list[float]:
    """1, 1/2, 1/4, ... normalised to sum 1."""
    raw = [0.5**k for k in range(n_levels)]
    return [w / sum(raw) for w in raw]


def _check_weights(weights: Mapping[str, float], labels: LabelSpec = KAGGLE) -> dict[str, float]:
    check_terms(weights, labels)
    for name, w in weights.items():
        if not w >= 0:  # also rejects NaN
            raise CtsegError(f"loss weight {name}={w!r}: must be >= 0")
    return {name: float(weights[name]) for name in TERMS if weights.get(name, 0) > 0}


def _check_level_weights(ds_weights: Sequence[float] | None, n_levels: int) -> list[float]:
    if ds_weights is None:
        return deep_supervision_weights(n_levels)
    ds_weights = [float(w) for w in ds_weights]
    if len(ds_weights) != n_levels:
        raise CtsegError(f"ds_weights has {len(ds_weights)} entries for {n_levels} outputs")
    if any(not w >= 0 for w in ds_weights) or sum(ds_weights) <= 0:
        raise CtsegError(f"ds_weights={ds_weights}: must be >= 0 with a positive sum")
    # Normalised like the default, so switching deep supervision on keeps the loss scale.
    return [w / sum(ds_weights) for w in ds_weights]


def compute_losses(
    logits_or_list: torch.Tensor | Sequence[torch.Tensor],
    batch: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    *,
    pos_weight: float = 1.0,
    cldice_iterations: int = 3,
    clip_distance: float = 8.0,
    ds_weights: Sequence[float] | None = None,
    labels: LabelSpec = KAGGLE,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(total, terms): total = sum over terms of weights[name] * terms[name].

    Terms whose weight is 0 (or absent) are neither computed nor reported. For a list of
    logits (deep supervision, [full, 1/2, 1/4, ...]) each term is the level-weighted sum
    sum_k ds_weights[k] * term_k, with ds_weights normalised to sum 1 (default 1, 1/2, 1/4, ...).
    ``clip_distance`` must be the d the sdt was clipped at; ``labels`` is the dataset's label
    convention (which values are ignored, which foreground).
    """
    active = _check_weights(weights, labels)
    if clip_distance <= 0:
        raise CtsegError(f"clip_distance={clip_distance!r}: must be > 0")
    if cldice_iterations < 0:
        raise CtsegError(f"cldice_iterations={cldice_iterations!r}: must be >= 0")
    outputs = [logits_or_list] if torch.is_tensor(logits_or_list) else list(logits_or_list)
    if not outputs:
        raise CtsegError("no logits given")
    level_w = _check_level_weights(ds_weights, len(outputs))
    full = outputs[0]
    channels = labels.out_channels
    if full.ndim != 5 or full.shape[1] != channels:
        raise CtsegError(
            f"logits of shape {tuple(full.shape)}: expected (B, {channels}, Z, Y, X) for "
            f"{labels.n_classes} foreground class(es)"
        )
    names = list(active)
    needed = needed_targets(names)

    # Autocast off: the loss runs in float32 whatever precision the network ran in.
    with torch.autocast(device_type=full.device.type, enabled=False):
        # The targets have one channel (``classes`` K+1): the label is (B, 1, Z, Y, X).
        shape = torch.Size((full.shape[0], 1, *full.shape[2:]))
        targets = prepare_targets(batch, shape, needed, labels)
        terms: dict[str, Any] = {}
        for k, (logits, w) in enumerate(zip(outputs, level_w, strict=True)):
            if w == 0:
                continue
            t = downsample_targets(targets, 2**k)
            expected = t["classes" if "classes" in t else "target"].shape
            if logits.shape != expected:
                raise CtsegError(
                    f"output {k} has shape {tuple(logits.shape)}; expected "
                    f"{tuple(expected)} (1/{2**k} of {tuple(full.shape[2:])}, ceil)"
                )
            level = level_terms(
                logits,
                t,
                names,
                pos_weight=pos_weight,
                cldice_iterations=cldice_iterations,
                clip_distance=clip_distance,
            )
            for name, value in level.items():
                terms[name] = terms.get(name, 0.0) + w * value
        total = sum((active[n] * terms[n] for n in names), full.new_zeros((), dtype=torch.float32))
    return total, terms


def loss_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments for `compute_losses` from a config mapping with ``weights`` and the
    optional ``pos_weight``, ``cldice_iterations``, ``clip_distance``, ``ds_weights``."""
    allowed = {"weights", "pos_weight", "cldice_iterations", "clip_distance", "ds_weights"}
    unknown = sorted(set(cfg) - allowed)
    if unknown:
        raise CtsegError(f"loss config: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    if "weights" not in cfg:
        raise CtsegError("loss config: 'weights' is required")
    _check_weights(cfg["weights"])
    return dict(cfg)
