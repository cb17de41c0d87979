"""The micro-batch as it goes to a device: versions laid out like logprobs, one move, zero-loss padding; and
an unsharded update under autocast (``ppo.compute_dtype=bfloat16``) on the CPU."""

import torch

from areal_agents.config import PPOConfig
from areal_agents.trainers.batching import make_micro_batches
from areal_agents.trainers.policy import load_trainable
from areal_agents.trainers.policy_api import TrainSpec
from areal_agents.trainers.ppo_batch import precision
from areal_agents.types import Trajectory
from tests.trainers.test_distributed import _batch

# two trajectories: 2 prompt tokens then 3 generated at versions 4, 4, 5; 1 prompt token then 1 at version 7
TRAJS = [
    Trajectory([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], [0, 0, -1.0, -1.0, -1.0], [-1, -1, 4, 4, 5], 1.0, "g"),
    Trajectory([1, 6], [0, 1], [0, -2.0], [-1, 7], 0.0, "g"),
]


def test_versions_are_laid_out_like_logprobs_padded_and_packed():
    (padded,) = make_micro_batches(TRAJS, 64, pad_token_id=0)
    assert padded.versions.dtype == torch.long and padded.versions.shape == padded.logprobs.shape
    by_row = {tuple(padded.input_ids[r, : len(t)].tolist()): r for r, t in zip(range(2), sorted(TRAJS, key=len))}
    assert padded.versions[by_row[(1, 2, 3, 4, 5)]].tolist() == [-1, -1, 4, 4, 5]
    assert padded.versions[by_row[(1, 6)]].tolist() == [-1, 7, -1, -1, -1]  # the pad is -1 too
    (packed,) = make_micro_batches(TRAJS, 64, pack=True)
    assert packed.versions.tolist() == [[-1, 7, -1, -1, 4, 4, 5]]  # packed shortest first, as the tokens
    assert packed.input_ids.tolist() == [[1, 6, 1, 2, 3, 4, 5]]


def test_a_micro_batch_on_its_device_is_not_copied_and_padding_trains_nothing():
    (mb,) = make_micro_batches(TRAJS, 64, pack=True)
    assert mb.to(torch.device("cpu")) is mb  # the CPU path: no copy at all
    pad = mb.padding()
    assert pad.num_loss_tokens == 0 and pad.index == [] and pad.attended == 0
    assert torch.equal(pad.input_ids, mb.input_ids)  # the same forward as the original
    assert mb.attended == 2 * 3 // 2 + 5 * 6 // 2 and mb.num_loss_tokens == 4  # the original is untouched


def test_float32_on_cpu_adds_no_autocast(tiny_dir):
    spec = TrainSpec(PPOConfig(device="cpu"), 1.0, 0, "float32", total_steps=1)
    policy = load_trainable("policy", spec, str(tiny_dir), str(tiny_dir))
    with precision(policy.model, spec.ppo)():
        assert not torch.is_autocast_enabled("cpu")
    bf16 = PPOConfig(device="cpu", compute_dtype="bfloat16")
    with precision(policy.model, bf16)():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    policy.spec = TrainSpec(bf16, 1.0, 0, "float32", total_steps=1)
    stats = policy.train_step(_batch(), torch.Generator().manual_seed(0))
    assert stats["optimizer_steps"] == 1 and torch.isfinite(torch.tensor(stats["loss"]))
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())  # master weights stay float32
    assert all(torch.isfinite(p).all() for p in policy.model.parameters())
