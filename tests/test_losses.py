"""Loss terms: minima at the perfect prediction, ignore-region invariance, weighting, stability."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import ndimage

from ctseg.io import CtsegError
from ctseg.network.losses import (
    TERMS,
    boundary_minimum,
    compute_losses,
    deep_supervision_weights,
    downsample_targets,
    loss_settings,
    prepare_targets,
    soft_skeleton,
)

CLIP = 4.0
ALL_ONE = dict.fromkeys(TERMS, 1.0)
SHAPE = (2, 1, 16, 20, 20)


def make_batch(shape=SHAPE, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two sheets per sample (a flat 2-voxel one, a tilted one), an unlabelled slab at x >= 14,
    a mid-surface skeleton, a tube that pokes out of the sheet (as an undilated-then-unmasked
    target would) and the clipped signed distance."""
    rng = np.random.default_rng(seed)
    b, _, nz, ny, nx = shape
    label = np.zeros((b, nz, ny, nx), np.uint8)
    skeleton = np.zeros_like(label)
    z, y, _ = np.meshgrid(np.arange(nz), np.arange(ny), np.arange(nx), indexing="ij")
    for i in range(b):
        z0 = int(rng.integers(3, 6))
        label[i][(z == z0) | (z == z0 + 1)] = 1
        skeleton[i][z == z0] = 1
        tilted = np.abs(z - (nz - 5) + (y // 4)) <= 1
        label[i][tilted] = 1
        skeleton[i][z == (nz - 5) - (y // 4)] = 1
    skeleton &= label
    tube = np.stack([ndimage.binary_dilation(s, iterations=2) for s in skeleton]).astype(np.uint8)
    fg = label == 1
    sdt = np.stack(
        [ndimage.distance_transform_edt(~f) - ndimage.distance_transform_edt(f) for f in fg]
    ).clip(-CLIP, CLIP)
    ignore = np.zeros_like(label)
    ignore[..., 14:] = 1
    label[ignore == 1] = 2
    to_t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a[:, None])).to(dt)  # noqa: E731
    return {
        "label": to_t(label, torch.uint8),
        "ignore": to_t(ignore, torch.uint8),
        "skeleton": to_t(skeleton, torch.uint8),
        "tube": to_t(tube, torch.uint8),
        "sdt": to_t(sdt, torch.float32),
    }


def perfect_logits(batch, big: float = 30.0) -> torch.Tensor:
    return torch.where(batch["label"] == 1, big, -big).float()


def term_values(logits, batch, **kw) -> dict[str, float]:
    kw.setdefault("clip_distance", CLIP)
    _, terms = compute_losses(logits, batch, ALL_ONE, **kw)
    return {k: float(v) for k, v in terms.items()}


def other_predictions(batch) -> list[torch.Tensor]:
    """Random, constant, inverted and slightly perturbed versions of the perfect prediction."""
    gen = torch.Generator().manual_seed(1)
    perfect = perfect_logits(batch)
    out = [torch.randn(perfect.shape, generator=gen) * s for s in (0.5, 3.0, 30.0)]
    out += [torch.full_like(perfect, c) for c in (-30.0, 0.0, 30.0)]
    out.append(-perfect)
    for frac in (0.01, 0.1):
        flip = torch.rand(perfect.shape, generator=gen) < frac
        out.append(torch.where(flip, -perfect, perfect))
    soft = perfect / 10  # right side everywhere, but not confident
    out.append(soft)
    return out


# -- minima -------------------------------------------------------------------------------------


def test_perfect_prediction_reaches_each_documented_minimum():
    batch = make_batch()
    best = term_values(perfect_logits(batch), batch)
    assert set(best) == set(TERMS)
    for name in ("bce", "dice", "cldice", "skel_recall"):
        assert best[name] == pytest.approx(0.0, abs=1e-6), name
    # The boundary minimum, computed independently: mean(min(sdt, 0)) / d over valid voxels.
    valid = batch["ignore"] == 0
    expected = float((batch["sdt"][valid].clamp_max(0) / CLIP).mean())
    assert expected < -0.05
    assert float(boundary_minimum(batch, CLIP)) == pytest.approx(expected, abs=1e-6)
    assert best["boundary"] == pytest.approx(expected, abs=1e-6)


def test_any_other_prediction_is_no_better():
    batch = make_batch()
    best = term_values(perfect_logits(batch), batch)
    for i, logits in enumerate(other_predictions(batch)):
        values = term_values(logits, batch)
        for name in TERMS:
            assert values[name] >= best[name] - 1e-6, (i, name)
    # And each term does notice something: the inverted prediction is much worse everywhere.
    worst = term_values(-perfect_logits(batch), batch)
    for name in TERMS:
        assert worst[name] > best[name] + 0.1, name


def test_boundary_term_is_linear_in_p_with_the_sdt():
    batch = make_batch()
    logits = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    got = term_values(logits, batch)["boundary"]
    valid = batch["ignore"] == 0
    p = torch.sigmoid(logits)
    expected = float((p[valid] * batch["sdt"][valid] / CLIP).mean())
    assert got == pytest.approx(expected, rel=1e-5)


def test_terms_match_their_formulas_on_a_random_prediction():
    batch = make_batch()
    logits = torch.randn(SHAPE, generator=torch.Generator().manual_seed(4)) * 2
    got = term_values(logits, batch, pos_weight=3.0, cldice_iterations=2)
    valid = batch["ignore"] == 0
    t = (batch["label"] == 1).float()
    bce = F.binary_cross_entropy_with_logits(logits[valid], t[valid], pos_weight=torch.tensor(3.0))
    assert got["bce"] == pytest.approx(float(bce), rel=1e-5)
    p = torch.sigmoid(logits) * valid
    dice = 1 - (2 * (p * t).sum() + 1) / (p.sum() + t.sum() + 1)  # batch dice, smooth 1
    assert got["dice"] == pytest.approx(float(dice), rel=1e-5)
    tube = batch["tube"].float() * t  # the tube is restricted to the sheet
    recall = ((p * tube).sum() + 1) / (tube.sum() + 1)
    assert got["skel_recall"] == pytest.approx(float(1 - recall), rel=1e-5)
    sp = soft_skeleton(p, 2) * valid
    st = batch["skeleton"].float() * t  # the skeleton too, so none of it lies in the ignore slab
    tprec = ((sp * t).sum() + 1) / (sp.sum() + 1)
    tsens = ((st * p).sum() + 1) / (st.sum() + 1)
    cldice = 1 - 2 * tprec * tsens / (tprec + tsens)
    assert got["cldice"] == pytest.approx(float(cldice), rel=1e-5)


def test_pos_weight_scales_the_positive_part_of_bce():
    batch = make_batch()
    logits = torch.zeros(SHAPE)  # every voxel costs log 2, times pos_weight where t = 1
    valid = batch["ignore"] == 0
    frac_pos = float((batch["label"][valid] == 1).float().mean())
    for pw in (1.0, 5.0):
        got = term_values(logits, batch, pos_weight=pw)["bce"]
        assert got == pytest.approx(np.log(2) * (pw * frac_pos + 1 - frac_pos), rel=1e-5)


# -- ignore region ------------------------------------------------------------------------------


def test_logits_in_the_ignore_region_change_no_term_and_get_no_gradient():
    batch = make_batch()
    ignored = batch["ignore"] == 1
    base = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    reference = term_values(base, batch)
    for junk in (torch.full(SHAPE, 30.0), torch.full(SHAPE, -30.0), torch.randn(SHAPE) * 1e4):
        changed = torch.where(ignored, junk, base)
        assert term_values(changed, batch) == pytest.approx(reference, abs=1e-6)
    # Even non-finite junk stays out of the terms and the gradient.
    junk = torch.where(ignored, torch.nan, base).requires_grad_()
    total, terms = compute_losses(junk, batch, ALL_ONE, clip_distance=CLIP)
    total.backward()
    assert {k: float(v.detach()) for k, v in terms.items()} == pytest.approx(reference, abs=1e-6)
    assert torch.isfinite(junk.grad).all()
    assert (junk.grad[ignored] == 0).all()
    assert (junk.grad[~ignored] != 0).any()


def test_label_2_counts_as_ignored_even_if_the_ignore_mask_misses_it():
    batch = make_batch()
    logits = torch.randn(SHAPE, generator=torch.Generator().manual_seed(6))
    reference = term_values(logits, batch)
    no_mask = {k: v for k, v in batch.items() if k != "ignore"}
    assert term_values(logits, no_mask) == pytest.approx(reference, abs=1e-6)


def test_coarse_ignore_region_changes_no_deep_supervision_term():
    batch = make_batch()
    gen = torch.Generator().manual_seed(7)
    shapes = [SHAPE, (2, 1, 8, 10, 10), (2, 1, 4, 5, 5)]
    outputs = [torch.randn(s, generator=gen) for s in shapes]
    reference = term_values(outputs, batch)
    targets = prepare_targets(batch, torch.Size(SHAPE), ["skeleton", "tube", "sdt"])
    changed = []
    for k, out in enumerate(outputs):
        coarse_valid = downsample_targets(targets, 2**k)["valid"] > 0
        assert (~coarse_valid).any(), k  # the test would be empty otherwise
        changed.append(torch.where(coarse_valid, out, torch.randn(out.shape) * 100))
    assert term_values(changed, batch) == pytest.approx(reference, abs=1e-6)


# -- weights ------------------------------------------------------------------------------------


def test_total_is_the_weighted_sum_of_the_reported_terms():
    batch = make_batch()
    logits = torch.randn(SHAPE, generator=torch.Generator().manual_seed(8))
    weights = {
        "bce": 0.7,
        "dice": 1.3,
        "cldice": 0.5,
        "skel_recall": 2.0,
        "boundary": 0.25,
        "ce": 0.4,
    }
    total, terms = compute_losses(logits, batch, weights, clip_distance=CLIP)
    assert set(terms) == set(TERMS)
    expected = sum(weights[k] * float(terms[k]) for k in TERMS)
    assert float(total) == pytest.approx(expected, rel=1e-6)
    # The terms do not depend on the weights.
    _, unit = compute_losses(logits, batch, ALL_ONE, clip_distance=CLIP)
    for k in TERMS:
        assert float(terms[k]) == pytest.approx(float(unit[k]), rel=1e-6)


def test_zero_or_absent_weight_removes_a_term():
    batch = make_batch()
    logits = torch.randn(SHAPE, generator=torch.Generator().manual_seed(9))
    _, all_terms = compute_losses(logits, batch, ALL_ONE, clip_distance=CLIP)
    total, terms = compute_losses(
        logits, batch, {"bce": 1.0, "dice": 2.0, "cldice": 0.0}, clip_distance=CLIP
    )
    assert set(terms) == {"bce", "dice"}
    assert float(total) == pytest.approx(float(all_terms["bce"] + 2 * all_terms["dice"]), rel=1e-6)
    # A term that is off needs no target: a batch without sdt, skeleton and tube is fine.
    small = {k: batch[k] for k in ("label", "ignore")}
    total2, _ = compute_losses(logits, small, {"bce": 1.0, "dice": 2.0}, clip_distance=CLIP)
    assert float(total2) == pytest.approx(float(total), rel=1e-6)
    with pytest.raises(KeyError, match="sdt"):
        compute_losses(logits, small, {"boundary": 1.0}, clip_distance=CLIP)


@pytest.mark.parametrize(
    "weights", [{"focal": 1.0}, {"dice": -1.0}, {"dice": float("nan")}], ids=str
)
def test_bad_weights_are_rejected(weights):
    batch = make_batch()
    with pytest.raises(CtsegError):
        compute_losses(torch.zeros(SHAPE), batch, weights)


def test_deep_supervision_default_level_weights():
    assert deep_supervision_weights(1) == pytest.approx([1.0])
    assert deep_supervision_weights(3) == pytest.approx([4 / 7, 2 / 7, 1 / 7])
    assert sum(deep_supervision_weights(5)) == pytest.approx(1.0)


def test_deep_supervision_total_and_terms_are_level_weighted_sums():
    batch = make_batch()
    gen = torch.Generator().manual_seed(10)
    shapes = [SHAPE, (2, 1, 8, 10, 10), (2, 1, 4, 5, 5)]
    outputs = [torch.randn(s, generator=gen) for s in shapes]
    weights = {"bce": 1.0, "dice": 0.5, "cldice": 0.3, "skel_recall": 0.2, "boundary": 0.1}
    kw = {"clip_distance": CLIP}
    per_level = [
        compute_losses(outputs, batch, weights, ds_weights=onehot, **kw)
        for onehot in ([1, 0, 0], [0, 1, 0], [0, 0, 1])
    ]
    # Level 0 alone is the plain single-output loss.
    single_total, _ = compute_losses(outputs[0], batch, weights, **kw)
    assert float(per_level[0][0]) == pytest.approx(float(single_total), rel=1e-6)

    for ds_weights, w in [(None, [4 / 7, 2 / 7, 1 / 7]), ([1.0, 1.0, 2.0], [0.25, 0.25, 0.5])]:
        total, terms = compute_losses(outputs, batch, weights, ds_weights=ds_weights, **kw)
        expected = sum(wk * float(lvl[0]) for wk, lvl in zip(w, per_level, strict=True))
        assert float(total) == pytest.approx(expected, rel=1e-6)
        for name in weights:
            expected = sum(wk * float(lvl[1][name]) for wk, lvl in zip(w, per_level, strict=True))
            assert float(terms[name]) == pytest.approx(expected, rel=1e-6)
        assert float(total) == pytest.approx(
            sum(weights[k] * float(terms[k]) for k in weights), rel=1e-6
        )


def test_deep_supervision_rejects_mismatched_outputs():
    batch = make_batch()
    good = [torch.zeros(SHAPE), torch.zeros(2, 1, 8, 10, 10)]
    with pytest.raises(CtsegError, match="ds_weights"):
        compute_losses(good, batch, ALL_ONE, ds_weights=[1.0], clip_distance=CLIP)
    with pytest.raises(CtsegError, match="output 1"):
        compute_losses([good[0], torch.zeros(2, 1, 8, 9, 9)], batch, ALL_ONE, clip_distance=CLIP)


def test_downsampled_targets_keep_thin_sheets_and_known_maxima():
    label = torch.zeros(1, 1, 8, 4, 4, dtype=torch.uint8)
    label[:, :, 3] = 1  # a one-voxel sheet at an odd z: strided slicing would drop it
    label[:, :, 6:, :, 2:] = 2  # unlabelled block
    label[:, :, 3, 0, 0] = 2  # one unlabelled voxel inside the sheet
    batch = {"label": label, "ignore": (label == 2).to(torch.uint8)}
    t = prepare_targets(batch, label.shape)
    half = downsample_targets(t, 2)
    assert half["target"].shape == (1, 1, 4, 2, 2)
    assert (half["target"][0, 0, 1] == 1).all()  # z cells {2, 3} hold the sheet
    assert half["target"].sum() == 4
    # Cells with a labelled sheet voxel stay valid; cells touching the unlabelled block do not.
    assert (half["valid"][0, 0, 1] == 1).all()
    assert (half["valid"][0, 0, 3, :, 1] == 0).all()
    assert (half["valid"][0, 0, 3, :, 0] == 1).all()
    assert half["valid"].sum() == 14
    quarter = downsample_targets(t, 4)
    assert quarter["target"].shape == (1, 1, 2, 1, 1)
    assert quarter["target"].flatten().tolist() == [1.0, 0.0]


def test_downsampled_sdt_is_negative_exactly_on_the_coarse_sheet():
    batch = make_batch()
    t = prepare_targets(batch, torch.Size(SHAPE), ["sdt"])
    for factor in (2, 4):
        coarse = downsample_targets(t, factor)
        valid = coarse["valid"] > 0
        inside = coarse["sdt"] < 0
        assert torch.equal(inside[valid], coarse["target"][valid] > 0), factor
        assert coarse["sdt"].abs().max() <= CLIP


# -- stability ----------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 30.0, -30.0, 1e4])
def test_gradients_are_finite(scale):
    batch = make_batch()
    if abs(scale) == 30.0:
        logits = perfect_logits(batch, scale)  # perfect, and (negative) perfectly wrong
    else:
        logits = torch.randn(SHAPE, generator=torch.Generator().manual_seed(11)) * scale
    logits.requires_grad_()
    total, terms = compute_losses(logits, batch, ALL_ONE, clip_distance=CLIP)
    total.backward()
    assert torch.isfinite(total)
    assert all(torch.isfinite(v) for v in terms.values())
    assert torch.isfinite(logits.grad).all()


def test_all_ignore_batch_gives_zero_without_nan():
    batch = make_batch()
    batch["ignore"] = torch.ones_like(batch["ignore"])
    outputs = [torch.randn(SHAPE, requires_grad=True), torch.randn(2, 1, 8, 10, 10)]
    outputs[1].requires_grad_()
    total, terms = compute_losses(outputs, batch, ALL_ONE, clip_distance=CLIP)
    total.backward()
    assert total.item() == 0.0
    assert all(v.item() == 0.0 for v in terms.values())
    for out in outputs:
        assert torch.isfinite(out.grad).all()
        assert (out.grad == 0).all()


def test_low_precision_logits_give_a_float32_loss():
    batch = make_batch()
    base = torch.randn(SHAPE, generator=torch.Generator().manual_seed(12))
    ref, _ = compute_losses(base.bfloat16().float(), batch, ALL_ONE, clip_distance=CLIP)
    for dtype in (torch.bfloat16, torch.float16):
        logits = base.to(dtype).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total, terms = compute_losses(logits, batch, ALL_ONE, clip_distance=CLIP)
        total.backward()
        assert total.dtype == torch.float32
        assert all(v.dtype == torch.float32 for v in terms.values())
        assert torch.isfinite(logits.grad.float()).all()
        if dtype == torch.bfloat16:
            assert total.item() == pytest.approx(float(ref), rel=1e-5)


# -- soft skeleton ------------------------------------------------------------------------------


def reference_soft_skel(img: torch.Tensor, iter_: int) -> torch.Tensor:
    """The 3D branch of soft_skeleton.py in github.com/jocpae/clDice, as published."""

    def soft_erode(img):
        p1 = -F.max_pool3d(-img, (3, 1, 1), (1, 1, 1), (1, 0, 0))
        p2 = -F.max_pool3d(-img, (1, 3, 1), (1, 1, 1), (0, 1, 0))
        p3 = -F.max_pool3d(-img, (1, 1, 3), (1, 1, 1), (0, 0, 1))
        return torch.min(torch.min(p1, p2), p3)

    def soft_dilate(img):
        return F.max_pool3d(img, (3, 3, 3), (1, 1, 1), (1, 1, 1))

    def soft_open(img):
        return soft_dilate(soft_erode(img))

    img1 = soft_open(img)
    skel = F.relu(img - img1)
    for _ in range(iter_):
        img = soft_erode(img)
        img1 = soft_open(img)
        delta = F.relu(img - img1)
        skel = skel + F.relu(delta - skel * delta)
    return skel


@pytest.mark.parametrize("iterations", [0, 1, 3, 5])
def test_soft_skeleton_matches_the_reference_implementation(iterations):
    x = torch.rand(2, 1, 10, 12, 14, generator=torch.Generator().manual_seed(13))
    assert torch.equal(soft_skeleton(x, iterations), reference_soft_skel(x, iterations))


def test_soft_skeleton_of_a_thick_sheet_is_thinner_and_inside_it():
    sheet = torch.zeros(1, 1, 24, 16, 16)
    sheet[:, :, 8:15] = 1.0  # 7 voxels thick
    skel = soft_skeleton(sheet, iterations=3)
    assert skel.sum() > 0
    assert (skel[sheet == 0] == 0).all()
    thickness = int((skel[0, 0, :, 8, 8] > 0.5).sum())
    assert 1 <= thickness < 7
    assert skel.sum() < sheet.sum() / 3


def test_loss_settings_validates_a_config_mapping():
    cfg = {"weights": {"bce": 1.0, "dice": 1.0}, "pos_weight": 2.0, "clip_distance": CLIP}
    kwargs = loss_settings(cfg)
    batch = make_batch()
    total, terms = compute_losses(torch.zeros(SHAPE), batch, **kwargs)
    assert set(terms) == {"bce", "dice"}
    with pytest.raises(CtsegError, match="unknown"):
        loss_settings({"weights": {}, "pos_wieght": 2.0})
    with pytest.raises(CtsegError, match="weights"):
        loss_settings({"pos_weight": 2.0})


def test_model_deep_supervision_outputs_fit_the_loss_on_an_odd_patch():
    from ctseg.network.model import UNet3D

    shape = (1, 1, 15, 19, 21)
    batch = make_batch(shape)
    model = UNet3D(filters=(2, 2, 2, 2), norm="none", deep_supervision=True)
    outputs = model(torch.randn(shape))
    assert [tuple(o.shape[2:]) for o in outputs] == [(15, 19, 21), (8, 10, 11), (4, 5, 6)]
    total, terms = compute_losses(outputs, batch, ALL_ONE, clip_distance=CLIP)
    total.backward()
    assert set(terms) == set(TERMS)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_bce_written_out_equals_torch_bce_with_logits_at_large_logits():
    """bce_term's softplus form against F.binary_cross_entropy_with_logits, logits to +-80."""
    batch = make_batch()
    valid = batch["ignore"] == 0
    t = (batch["label"] == 1).float()
    logits = torch.randn(SHAPE, generator=torch.Generator().manual_seed(9)) * 40
    got = term_values(logits, batch, pos_weight=2.5)["bce"]
    bce = F.binary_cross_entropy_with_logits(logits[valid], t[valid], pos_weight=torch.tensor(2.5))
    assert got == pytest.approx(float(bce), rel=1e-5)
