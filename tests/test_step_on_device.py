"""A training step keeps to the device: no value is read back to the host between logged steps,
and with channels_last no tensor changes its memory format inside the step (issue 31).

The host reads are counted here by patching torch.Tensor's own methods, independently of the
probes bench/mfu.py uses (`ctseg.training.probes`), which are checked against the same counts.
"""

from __future__ import annotations

import collections
import copy
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO
from training_setup import EXPERIMENT, PHASE

from ctseg.network.losses import compute_losses
from ctseg.network.model import build_model
from ctseg.training.distributed import Ranks
from ctseg.training.feeds import ResidentBatches
from ctseg.training.probes import count_host_syncs, count_layout_changes, layout_of
from ctseg.training.step_values import materialise
from ctseg.training.train import log_step, setup, train_step

sys.path.insert(0, str(REPO / "bench"))
import mfu  # noqa: E402

PATCH = [16, 16, 16]
READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def synthetic_batch(batch: int, memory_format: torch.memory_format) -> dict[str, torch.Tensor]:
    """bench/mfu.py's batch (sheets every 8 voxels in z, a few unlabelled rows: every loss term
    has work) in `memory_format`."""
    host = mfu.synthetic_batch(batch, PATCH, torch.device("cpu"))
    return {k: v.contiguous(memory_format=memory_format) for k, v in host.items()}


def tiny_run(tmp_path: Path, channels_last: bool, log_every: int) -> object:
    exp = copy.deepcopy(EXPERIMENT)
    exp["model"]["norm"] = "instance_layout"
    exp["data"]["patch_size"] = PATCH
    exp["train"]["log_every"] = log_every
    phase = {**PHASE, "batch_size": 2, "channels_last": channels_last}
    run = setup(exp, phase, Ranks(), torch.device("cpu"), {}, 4.0, 100, tmp_path, None)
    run.log_every = log_every
    return run


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def read(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    return counts


def test_steps_between_logged_ones_read_nothing_back_to_the_host(
    tmp_path: Path, host_reads: collections.Counter
) -> None:
    run = tiny_run(tmp_path, channels_last=True, log_every=4)
    batch = synthetic_batch(2, torch.channels_last_3d)
    batches = iter(ResidentBatches(iter([(batch, 0.0, 0.0)]), run.micro_steps))
    log_step(run, train_step(run, batches), None)  # step 1: torch's one-off setup
    host_reads.clear()
    steps = []
    for _ in range(2):  # steps 2 and 3 of log_every 4: stepped and logged, not yet written
        steps.append(train_step(run, batches))
        log_step(run, steps[-1], None)
    assert sum(host_reads.values()) == 0, dict(host_reads)
    for numbers in steps:  # the step's values are device tensors, read later
        assert torch.is_tensor(numbers["loss"]) and torch.is_tensor(numbers["grad_norm"])
        assert all(torch.is_tensor(v) for v in numbers["terms"].values())
    assert len(run.pending) == 3 and "loss" not in run.steps_log[-1]

    # The logged step reads them all at once, into plain numbers.
    materialise(run)
    assert host_reads == {"tolist": 1}
    assert [row["step"] for row in run.steps_log] == [1, 2, 3]
    for row in run.steps_log:
        assert isinstance(row["loss"], float) and row["loss"] == row["loss"]
        assert row["grad_norm"] > 0 and row["step_s"] > 0
        assert row["samples_per_s"] == pytest.approx(2 / row["step_s"])
        assert set(steps[0]["terms"]) <= set(row)
    assert run.pending == []


def test_the_probe_counts_the_same_reads(tmp_path: Path, host_reads: collections.Counter) -> None:
    """bench/mfu.py's `count_host_syncs` sees what the patched methods see: nothing in a step,
    and a read where one is made."""
    run = tiny_run(tmp_path, channels_last=True, log_every=4)
    batch = synthetic_batch(2, torch.channels_last_3d)
    batches = iter(ResidentBatches(iter([(batch, 0.0, 0.0)]), run.micro_steps))
    train_step(run, batches)
    host_reads.clear()
    with count_host_syncs() as probe:
        numbers = train_step(run, batches)
    assert sum(probe.values()) == 0 == sum(host_reads.values())
    with count_host_syncs() as probe:
        float(numbers["loss"])
        numbers["grad_norm"].item()
    assert probe == {"__float__": 1, "item": 1}


def test_the_torch_optimizer_loop_would_read_every_step_and_fused_does_not(
    host_reads: collections.Counter,
) -> None:
    """Why the fused optimizer is the default: torch's AdamW loop reads each parameter's step
    count back to the host on every step."""
    model = torch.nn.Conv3d(2, 2, 3)
    for fused, expected_reads in ((False, len(list(model.parameters()))), (True, 0)):
        optimizer = torch.optim.AdamW(model.parameters(), fused=fused)
        model(torch.randn(1, 2, 4, 4, 4)).sum().backward()
        optimizer.step()
        host_reads.clear()
        optimizer.step()
        assert host_reads["item"] == expected_reads, fused


def test_a_channels_last_step_changes_no_layout_and_torch_instance_norm_would(
    tmp_path: Path,
) -> None:
    run = tiny_run(tmp_path, channels_last=True, log_every=4)
    batch = synthetic_batch(2, torch.channels_last_3d)
    batches = iter(ResidentBatches(iter([(batch, 0.0, 0.0)]), run.micro_steps))
    train_step(run, batches)
    with count_layout_changes() as changes:
        train_step(run, batches)
    assert sum(changes.values()) == 0, dict(changes)
    # The counter is not blind: nn.InstanceNorm3d copies to contiguous and back.
    exp = copy.deepcopy(EXPERIMENT)
    exp["model"]["norm"] = "instance"
    model = build_model(exp["model"]).to(memory_format=torch.channels_last_3d)
    x = synthetic_batch(2, torch.channels_last_3d)["image"]
    with count_layout_changes() as changes:
        outputs = model(x)
        sum(o.float().sum() for o in outputs).backward()
    assert sum(changes.values()) > 0
    assert any("-> contiguous" in what for what in changes)


def test_layout_of_names_the_order_of_the_strides() -> None:
    x = torch.zeros(2, 3, 4, 5, 6)
    assert layout_of(x) == "contiguous"
    assert layout_of(x.contiguous(memory_format=torch.channels_last_3d)) == "channels_last"
    assert layout_of(x.permute(0, 2, 1, 3, 4)) == "other"
    assert layout_of(torch.zeros(2, 1, 4, 5, 6)) is None  # one channel: both formats alike
    assert layout_of(torch.zeros(4, 5)) is None


def test_loss_terms_in_channels_last_equal_the_contiguous_ones() -> None:
    """The deep-supervision logits of a channels_last network and the same logits contiguous,
    with targets in either layout: every term and the total agree, and their gradients too."""
    exp = copy.deepcopy(EXPERIMENT)
    exp["model"].update(norm="instance_layout", out_channels=1)
    torch.manual_seed(0)
    model = build_model(exp["model"]).to(memory_format=torch.channels_last_3d)
    batch_cl = synthetic_batch(2, torch.channels_last_3d)
    logits = model(batch_cl["image"])
    weights = EXPERIMENT["loss"]["weights"]
    results = {}
    for name, fmt in (("channels_last", torch.channels_last_3d), ("contiguous", None)):
        level = [
            (o.detach().contiguous(memory_format=fmt) if fmt else o.detach().contiguous())
            .clone()
            .requires_grad_()
            for o in logits
        ]
        batch = batch_cl if fmt else {k: v.contiguous() for k, v in batch_cl.items()}
        with count_layout_changes() as changes:
            total, terms = compute_losses(level, batch, weights, pos_weight=2.0, clip_distance=4)
            total.backward()
        assert sum(changes.values()) == 0, (name, dict(changes))
        results[name] = (total, terms, [t.grad for t in level])
    (t_cl, terms_cl, g_cl), (t_c, terms_c, g_c) = results["channels_last"], results["contiguous"]
    torch.testing.assert_close(t_cl, t_c)
    assert terms_cl.keys() == terms_c.keys() == weights.keys()
    for key in terms_cl:
        torch.testing.assert_close(terms_cl[key], terms_c[key])
    for a, b in zip(g_cl, g_c, strict=True):
        torch.testing.assert_close(a, b)
