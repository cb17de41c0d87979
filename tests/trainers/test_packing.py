"""Packed micro-batches: the same token logprobs and gradients as padded ones, and sane bins."""

import random

import pytest
import torch

from areal_agents.trainers.batching import make_micro_batches, token_logprobs
from areal_agents.trainers.packing import ffd_bins
from areal_agents.types import Trajectory


def test_ffd_bins_respect_the_budget_and_cover_everything():
    lengths = [5, 40, 7, 33, 12, 60, 1, 18]
    bins = ffd_bins(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert len(bins) == 3  # 176 tokens: three bins is optimal
    assert ffd_bins([100, 3], 64) == [[0], [1]]  # too long for a bin: one of its own


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_and_gradients_equal_padded(model, temperature):
    rng = random.Random(0)
    trajs = []
    for _ in range(11):
        n = rng.choice([4, 9, 9, 17, 30, 6])
        trajs.append(Trajectory([rng.randrange(4, 90) for _ in range(n)], [0, 0] + [1] * (n - 2), [0.0] * n, [-1] * n))

    def run(pack):
        model.zero_grad(set_to_none=True)
        out = [None] * len(trajs)
        for mb in make_micro_batches(trajs, 48, pad_token_id=0, pack=pack):
            logp = token_logprobs(model, mb, temperature)
            (logp * mb.loss_mask).sum().backward()
            for (row, a, b), i in zip(mb.slices, mb.index):
                out[i] = logp[row, a:b].detach()
        return out, model.model.layers[0].self_attn.q_proj.weight.grad.clone()

    padded, grad_padded = run(False)
    packed, grad_packed = run(True)
    for x, y in zip(padded, packed):
        assert torch.allclose(x, y, atol=1e-5)
    assert torch.allclose(grad_padded, grad_packed, atol=1e-4)
