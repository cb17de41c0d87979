"""Packed micro-batches: the same token logprobs and gradients as padded ones, and sane bins."""

import random

import pytest
import torch

from areal_agents.trainers.batching import make_micro_batches, token_logprobs
from areal_agents.trainers.packing import ffd_bins, prompt_length, prompt_units
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


def _groups_sharing_prompts(rng: random.Random, groups: int, members: int) -> list[Trajectory]:
    """GRPO-shaped data: each group's members share a prompt and differ after it (one has none left)."""
    trajs = []
    for g in range(groups):
        prompt = [rng.randrange(4, 90) for _ in range(rng.choice([1, 3, 7, 12]))]
        for k in range(members):
            completion = [rng.randrange(4, 90) for _ in range(0 if k == 0 and g == 0 else rng.choice([1, 2, 5, 9]))]
            n = len(prompt) + len(completion)
            mask = [0] * len(prompt) + [1] * len(completion)
            trajs.append(Trajectory(prompt + completion, mask, [0.0] * n, [-1] * n))
    trajs.append(Trajectory([5, 6, 7], [1, 1, 1], [0.0] * 3, [-1] * 3))  # no prompt at all
    return trajs


@pytest.mark.parametrize("budget", [40, 4096])
def test_shared_prompts_give_the_unshared_logprobs_and_gradients(model, budget):
    trajs = _groups_sharing_prompts(random.Random(1), groups=5, members=4)

    def run(share):
        model.zero_grad(set_to_none=True)
        out = [None] * len(trajs)
        mbs = make_micro_batches(trajs, budget, pad_token_id=0, pack=True, share_prompts=share)
        assert sorted(i for mb in mbs for i in mb.index) == list(range(len(trajs)))
        for mb in mbs:
            assert mb.num_tokens <= budget or len(mb.index) == 1
            logp = token_logprobs(model, mb, 0.8)
            (logp * mb.loss_mask).sum().backward()
            for (row, a, b), i in zip(mb.slices, mb.index):
                out[i] = logp[row, a:b].detach()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return out, grads, sum(mb.num_tokens for mb in mbs)

    packed, grads_packed, tokens_packed = run(False)
    shared, grads_shared, tokens_shared = run(True)
    assert tokens_shared < tokens_packed  # each prompt is computed once per row
    for x, y in zip(packed, shared):
        assert torch.allclose(x, y, atol=1e-5)
    assert len(grads_packed) == len(grads_shared)
    for g, h in zip(grads_packed, grads_shared):
        assert torch.allclose(g, h, atol=1e-4)


def test_shared_prompt_units_fit_the_budget_and_keep_groups_together():
    trajs = _groups_sharing_prompts(random.Random(2), groups=6, members=8)
    units, sizes = prompt_units(trajs, 30)
    assert sorted(i for u in units for i in u) == list(range(len(trajs)))
    for unit, size in zip(units, sizes):
        prompts = {tuple(trajs[i].input_ids[: prompt_length(trajs[i])]) for i in unit}
        assert len(prompts) == 1
        (prompt,) = prompts
        assert size == len(prompt) + sum(len(trajs[i]) - len(prompt) for i in unit)
        assert size <= 30 or len(unit) == 1


def test_packed_rows_under_activation_checkpointing_and_padded_calls_after(tiny_dir):
    """Backward re-runs checkpointed layers: they must see packed attention again (it used to be switched
    back after the forward); a padded call on the same model afterwards is back on ordinary attention."""
    from areal_agents.models import load_model

    trajs = _groups_sharing_prompts(random.Random(3), groups=3, members=4)

    def grads(model):
        model.zero_grad(set_to_none=True)
        for mb in make_micro_batches(trajs, 4096, pad_token_id=0, pack=True, share_prompts=True):
            (token_logprobs(model, mb) * mb.loss_mask).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain, checkpointed = load_model(tiny_dir), load_model(tiny_dir)
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    checkpointed.train()
    for g, h in zip(grads(plain), grads(checkpointed)):
        assert torch.allclose(g, h, atol=1e-5)
    padded = make_micro_batches(trajs, 4096, pad_token_id=0, pack=False)
    packed = make_micro_batches(trajs, 4096, pad_token_id=0, pack=True)
    with torch.no_grad():
        by_padded = {
            i: token_logprobs(plain, mb)[row, a:b] for mb in padded for (row, a, b), i in zip(mb.slices, mb.index)
        }
        for mb in packed:
            logp = token_logprobs(plain, mb)
            for (row, a, b), i in zip(mb.slices, mb.index):
                assert torch.allclose(logp[row, a:b], by_padded[i], atol=1e-5)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared prompts"])
def test_attention_runs_causal_without_any_mask(model, monkeypatch, layout):
    """Memory stays linear in length only if no path builds a mask (``T x T``, or ``W x (P + W)`` for a
    completion over its prompt): every SDPA call of every layout is a plain causal one."""
    import torch.nn.functional as F

    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((attn_mask, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    trajs = _groups_sharing_prompts(random.Random(4), groups=3, members=4)
    for mb in make_micro_batches(
        trajs, 4096, pad_token_id=0, pack=layout != "padded", share_prompts=layout == "shared prompts"
    ):
        (token_logprobs(model, mb) * mb.loss_mask).sum().backward()
    assert calls and all(mask is None and causal for mask, causal in calls)


def test_no_attention_plan_outlives_its_forward(model):
    """Plans were cached across updates (about 0.5 GB each at 16K tokens): memory that grew over a run."""
    import gc

    from areal_agents.trainers.packing import AttentionPlan

    trajs = _groups_sharing_prompts(random.Random(5), groups=2, members=3)
    for share in (False, True):
        for mb in make_micro_batches(trajs, 4096, pad_token_id=0, pack=True, share_prompts=share):
            (token_logprobs(model, mb) * mb.loss_mask).sum().backward()
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is AttentionPlan]
