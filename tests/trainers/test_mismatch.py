"""The train/inference mismatch in an update: measured on the tokens sampled at the trainer's own weights,
and corrected by leaving out whole trajectories whose geometric-mean behavior ratio leaves a band."""

import math

import pytest
import torch

from areal_agents.config import PPOConfig
from areal_agents.models import load_model
from areal_agents.trainers.batching import per_trajectory, token_logprobs
from areal_agents.trainers.ppo import ppo_update
from areal_agents.types import Trajectory


def _batch(model, shifts: list[float], versions: list[int]) -> list[Trajectory]:
    """Two groups of two; trajectory k's behavior logprobs are the model's own plus ``shifts[k]`` on every
    generated token, sampled (so the trajectory says) at version ``versions[k]``."""
    rows = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12, 13], [14, 15, 16, 17, 18], [14, 15, 16, 19, 20]]
    trajs = []
    for k, ids in enumerate(rows):
        mask = [0, 0, 0] + [1] * (len(ids) - 3)
        trajs.append(Trajectory(ids, mask, [0.0] * len(ids), [-1] * len(ids), float(k % 2), f"g{k // 2}"))
    with torch.no_grad():
        own = per_trajectory(lambda mb: token_logprobs(model, mb, 1.0), trajs, 4096, 0, pack=True)
    for t, lp, shift, v in zip(trajs, own, shifts, versions):
        t.logprobs = [float(x) + (shift if m else 0.0) for x, m in zip(lp, t.loss_mask)]
        t.versions = [v if m else -1 for m in t.loss_mask]
    return trajs


def _update(tiny_dir, trajs, cfg, version):
    model = load_model(tiny_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return ppo_update(
        model, optimizer, scheduler, trajs, cfg, temperature=1.0, pad_token_id=0, policy_version=version
    )  # fmt: skip


def test_mismatch_is_zero_at_equal_logprobs_and_k3_of_the_gap_on_the_current_versions_tokens(tiny_dir):
    model = load_model(tiny_dir)
    same = _update(tiny_dir, _batch(model, [0.0] * 4, [3] * 4), PPOConfig(), 3)
    assert same["mismatch_kl"] == pytest.approx(0.0, abs=1e-9) and same["mismatch_max_abs"] < 1e-5
    assert same["mismatch_tokens"] == 10.0  # every generated token was sampled at version 3
    # behavior logprobs 0.2 below the trainer's on version 3's tokens; version 2's are stale, not mismatch
    stats = _update(tiny_dir, _batch(model, [-0.2, -0.2, 1.5, 1.5], [3, 3, 2, 2]), PPOConfig(), 3)
    d = 0.2  # log π_train - log π_behav
    assert stats["mismatch_tokens"] == 6.0
    assert stats["mismatch_kl"] == pytest.approx(math.exp(d) - 1 - d, rel=1e-4)
    assert stats["mismatch_max_abs"] == pytest.approx(0.2, abs=1e-5)
    assert stats["seq_masked_fraction"] == 0.0


def test_the_sequence_mask_leaves_out_trajectories_outside_the_ratio_band(tiny_dir):
    model = load_model(tiny_dir)
    trajs = _batch(model, [0.0, -0.5, 0.0, 0.0], [0] * 4)  # trajectory 1: ratio e^0.5 = 1.65 on every token
    cfg = PPOConfig(behav_seq_ratio_min=0.5, behav_seq_ratio_max=1.5)
    stats = _update(tiny_dir, trajs, cfg, 0)
    assert stats["seq_masked_fraction"] == pytest.approx(3 / 10)
    # the same batch without trajectory 1's tokens in the loss: its group's other member trains alone
    unmasked = _update(tiny_dir, trajs, PPOConfig(), 0)
    assert unmasked["seq_masked_fraction"] == 0.0 and stats["loss"] != pytest.approx(unmasked["loss"])
