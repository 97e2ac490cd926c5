"""bench/recipe.py: its statistics and claims in seconds, and the whole ladder at its smallest
through the real `ctseg` CLI (slow), checking that each rung ran with the part it claims."""

from __future__ import annotations

import math
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import pipeline  # noqa: E402
import recipe  # noqa: E402

RESULT = re.compile(
    r"^RESULT recipe base=(?P<base>[0-9.]+) best=(?P<best>[0-9.]+) gain=(?P<gain>-?[0-9.]+) "
    r"gain_se=(?P<gain_se>[0-9.]+|nan) rungs=(?P<rungs>\d)$"
)


def test_standard_error_across_seeds_is_the_sample_sd_over_root_n() -> None:
    values = np.array([0.50, 0.52, 0.47, 0.55])
    expected = np.std(values, ddof=1) / 2
    assert recipe.standard_error(values, "seeds") == pytest.approx(expected)
    assert math.isnan(recipe.standard_error(values[:1], "seeds"))


def test_bootstrap_standard_error_is_near_the_analytic_one_and_reproducible() -> None:
    rng = np.random.default_rng(3)
    values = rng.normal(0.5, 0.1, size=40)
    analytic = np.std(values, ddof=0) / math.sqrt(len(values))
    se = recipe.standard_error(values, "bootstrap")
    assert se == recipe.standard_error(values, "bootstrap")  # seeded: the same figure each run
    assert 0.85 * analytic < se < 1.15 * analytic
    assert recipe.standard_error(np.full(5, 0.3), "bootstrap") == pytest.approx(0.0, abs=1e-12)


def test_spread_method_needs_three_seeds() -> None:
    assert recipe.spread_method(1) == "bootstrap" and recipe.spread_method(2) == "bootstrap"
    assert recipe.spread_method(3) == "seeds"


def test_verdict_says_when_a_rung_does_not_help() -> None:
    assert recipe.verdict(0.05, 0.01, 4) == "helps"
    assert recipe.verdict(-0.05, 0.01, 4) == "hurts"
    assert recipe.verdict(0.01, 0.01, 4) == "no clear difference"
    assert recipe.verdict(-0.01, 0.01, 4) == "no clear difference (does not help)"
    # Two volumes' bootstrap SE says little: no verdict, only the sign.
    assert recipe.verdict(0.05, 0.0, 2) == "higher (n=2: too few to tell)"


def test_a_claim_the_identity_does_not_show_stops_the_bench() -> None:
    evidence = {"ema": None, "block": "basic"}
    recipe.check_claim("r", evidence, {"ema": lambda v: v is None})
    with pytest.raises(recipe.ClaimFailed, match=r"r2: its run identity has ema=None"):
        recipe.check_claim("r2", evidence, {"ema": lambda v: bool(v)})


def test_sizes_give_an_ema_and_a_fine_tune_the_schema_accepts() -> None:
    from ctseg.config import experiment_from

    for steps in (3, 200, 500):
        args = recipe.parse_args(["--quick", "--steps", str(steps)])
        plan = recipe.sizes(args, [32, 48, 48])
        assert plan["finetune_patch"] == [48, 64, 64] and plan["seeds"] == [0]
        exp = pipeline.load_experiment("exp001")
        exp["train"]["ema"] = plan["ema"]
        # The schema's bounds: 0 <= decay < 1; what the bench writes must load.
        assert dict(experiment_from(exp, "test")["train"]["ema"])["decay"] == plan["ema"]["decay"]
    assert recipe.sizes(recipe.parse_args([]), [32, 48, 48])["seeds"] == [0, 1, 2]


def test_fine_tune_experiment_starts_from_its_source_at_the_larger_patch() -> None:
    source = pipeline.load_experiment("exp001")
    source["name"] = "r3_resenc_s0"
    source["train"]["ema"] = {"decay": 0.9, "start_step": 40}
    lad = types.SimpleNamespace(finetune_patch=[48, 64, 64], finetune_steps=20)
    exp = recipe.finetune_exp(lad, source, "r4_finetune_s0", 0)
    assert exp["init_from"] == "r3_resenc_s0" and exp["name"] == "r4_finetune_s0"
    assert exp["data"]["patch_size"] == [48, 64, 64]
    assert exp["train"]["steps_per_epoch"] == 20 and exp["train"]["epochs"] == 1
    assert exp["train"]["lr"] == pytest.approx(source["train"]["lr"] / 2)
    assert exp["train"]["ema"]["start_step"] == 4  # within the short schedule
    assert source["data"]["patch_size"] == [32, 48, 48]  # the source is left as it was


def _rung(number: int, key: str, per_volume: list[float]) -> recipe.Rung:
    rung = recipe.Rung(number, key, key, status="ran", train_steps=10)
    rung.scores = {0: {f"v{i}": {t: s for t in recipe.TERMS} for i, s in enumerate(per_volume)}}
    return rung


def test_report_pairs_the_deltas_and_shows_a_skipped_rung(capsys) -> None:
    base = _rung(1, "base", [0.40, 0.50, 0.60])
    skipped = recipe.Rung(2, "ema", "ema", status="skipped: train.ema not available")
    worse = _rung(3, "resenc", [0.39, 0.49, 0.59])  # lower by 0.01 on every volume
    lad = types.SimpleNamespace(
        rungs=[base, skipped, worse], seeds=[0], data=types.SimpleNamespace(test_ids=[1, 2, 3])
    )
    record: dict = {}
    got_base, best, gain_se = recipe.report(lad, "bootstrap", record)
    out = capsys.readouterr().out
    assert got_base is base and best is base and gain_se == 0.0
    fig = record["figures"]["resenc"]
    # Paired by volume: the difference is -0.01 on each, so its SE is 0 and it hurts.
    assert fig["delta_prev"] == pytest.approx(-0.01)
    assert fig["delta_prev_se"] == pytest.approx(0.0, abs=1e-12)
    assert fig["delta_prev_vs"] == 1 and fig["verdict"] == "hurts"
    assert "skipped: train.ema not available" in out and "bootstrap" in out


def test_equal_sample_schedules_give_each_batch_the_same_samples() -> None:
    got = recipe.equal_sample_schedules(640, [4, 16], warmup_steps=5)
    assert got == {4: {"steps": 160, "warmup_steps": 5}, 16: {"steps": 40, "warmup_steps": 1}}
    assert {b * s["steps"] for b, s in got.items()} == {640}
    # A warm-up longer than a tenth of the smallest batch's steps is cut to it, in samples.
    short = recipe.equal_sample_schedules(320, [4, 16], warmup_steps=50)
    assert short[4]["warmup_steps"] == 8 and short[16]["warmup_steps"] == 2
    with pytest.raises(ValueError, match=r"--samples 600: not a multiple of batch 16; .*608"):
        recipe.equal_sample_schedules(600, [4, 16], warmup_steps=5)


def test_spread_verdict_is_within_up_to_twice_the_se() -> None:
    assert recipe.spread_verdict(-0.019, 0.01, 4) == "within"
    assert recipe.spread_verdict(0.02, 0.01, 4) == "within"
    assert recipe.spread_verdict(-0.021, 0.01, 4) == "below"
    assert recipe.spread_verdict(0.021, 0.01, 4) == "above"
    assert recipe.spread_verdict(0.0, 0.01, 2) == "too_few"
    assert recipe.spread_verdict(0.0, float("nan"), 4) == "too_few"


def test_batch_phase_changes_only_the_batch_of_the_run_phase() -> None:
    phases = pipeline.load_phases()
    table = recipe.batch_phase(phases, 2, 16)
    assert table[2] == {**phases[2], "batch_size": 16}
    assert phases[2]["batch_size"] == 2 and table[6] == phases[6]  # the config is left as it was


def test_the_default_batch_phases_differ_in_their_maths_only_by_batch() -> None:
    """The batch rung trains one phase at both batches: that stands for phases 6 and 8 only
    while the settings that change the maths (as the run identity has them) agree."""
    from ctseg.training.checkpoint import run_identity

    phases = pipeline.load_phases()
    small, large = (phases[p] for p in recipe.BATCH_PHASES)
    assert (small["batch_size"], large["batch_size"]) == (4, 16)
    exp = pipeline.load_experiment("exp001")
    maths = [
        run_identity(exp, p, data={}, total_steps=1, clip_distance=1.0)["phase"]
        for p in (small, large)
    ]
    assert {**maths[0], "batch_size": 16} == maths[1]


def test_sqrt_scaling_gives_batch_16_twice_the_lr_of_batch_4() -> None:
    train = pipeline.load_experiment("exp001")["train"]
    assert train["lr_scaling"] == "sqrt" and train["base_batch_size"] == 1
    assert recipe.scaled_lr(train, 16) == pytest.approx(2 * recipe.scaled_lr(train, 4))
    assert recipe.scaled_lr({**train, "lr_scaling": "linear"}, 16) == pytest.approx(16 * 0.002)
    assert "sqrt" in recipe.lr_rules() and "linear" in recipe.lr_rules()


def test_batch_report_pairs_the_delta_and_gives_the_verdict(capsys) -> None:
    small = _rung(1, "batch4", [0.40, 0.50, 0.60, 0.45])
    large = _rung(2, "batch16", [0.37, 0.47, 0.57, 0.42])  # 0.03 lower on every volume
    for rung, (batch, steps) in zip((small, large), ((4, 160), (16, 40)), strict=True):
        rung.settings = {"batch_size": batch, "steps": steps, "warmup_steps": 1, "lr": 0.004}
    record = {"plan": {"batches": [4, 16], "lr_scaling": "sqrt"}}
    fig = recipe.report_batch([small, large], "bootstrap", record)
    out = capsys.readouterr().out
    assert fig["delta"] == pytest.approx(-0.03) and fig["delta_se"] == pytest.approx(0, abs=1e-12)
    assert fig["verdict"] == "below" and fig["units"] == 4
    assert fig["batch4_score"] == pytest.approx(0.4875) and record["figures"] is fig
    assert "delta (batch 16 - batch 4): -0.0300" in out and "below the spread" in out
    # The same scores a little noisier per volume: the delta is within twice its SE.
    large.scores[0]["v0"] = {t: 0.46 for t in recipe.TERMS}
    assert recipe.report_batch([small, large], "bootstrap", record)["verdict"] == "within"


def test_batch_rung_has_its_own_figures_file() -> None:
    assert recipe.parse_args(["--batch-rung"]).json.name == "recipe_batch.json"
    assert recipe.parse_args([]).json.name == "recipe.json"
    # By default a ladder model's samples, rounded up to a multiple of both batches: quick,
    # 150 steps of phase 2's batch 2 (300 -> 304); full size, 500 of phase 6's 4 (2000).
    assert recipe.ladder_samples(150, 2, [4, 16]) == 304
    assert recipe.ladder_samples(500, 4, [4, 16]) == 2000
