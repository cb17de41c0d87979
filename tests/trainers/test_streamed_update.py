"""`StreamedUpdate`: a batch fed in parts takes the optimizer step of the whole batch at once."""

import asyncio
import random

import pytest
import torch

from areal_agents.config import PPOConfig, TrainConfig
from areal_agents.models import load_model
from areal_agents.trainers.policy import load_trainable
from areal_agents.trainers.policy_api import TrainSpec
from areal_agents.trainers.ppo import StreamedUpdate, ppo_update
from areal_agents.types import Trajectory

REWARDS = {"g0": [0.0, 1.0, 0.0, 1.0], "g1": [1.0, 1.0, 1.0, 1.0], "g2": [0.0, 0.5, 1.0, 0.0]}  # g1: no variance


def groups() -> dict[str, list[Trajectory]]:
    """Three GRPO groups: a shared prompt each, completions of different lengths, behavior logprobs that differ."""
    rng = random.Random(0)
    out = {}
    for g, rewards in REWARDS.items():
        prompt = [rng.randrange(4, 90) for _ in range(3)]
        out[g] = []
        for k, r in enumerate(rewards):
            n = rng.choice([2, 5, 9])
            out[g].append(
                Trajectory(
                    prompt + [rng.randrange(4, 90) for _ in range(n)],
                    [0] * 3 + [1] * n,
                    [0.0] * 3 + [rng.uniform(-5.0, -3.5) for _ in range(n)],
                    [-1] * 3 + [0] * n,
                    reward=r,
                    group_id=g,
                    episode_id=f"{g}/e{k}",
                )
            )
    return out


def sgd(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_parts_take_the_step_of_the_whole_batch(tiny_dir, kl_coef):
    cfg = PPOConfig(kl_coef=kl_coef, max_grad_norm=1e9)
    reference = load_model(tiny_dir)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = groups()

    whole = load_model(tiny_dir)
    before = [p.detach().clone() for p in whole.parameters()]
    whole_stats = ppo_update(
        whole, *sgd(whole), [t for g in batch.values() for t in g], cfg, temperature=1.0, pad_token_id=0,
        ref_model=reference,
    )  # fmt: skip

    parts = load_model(tiny_dir)
    update = StreamedUpdate(parts, *sgd(parts), cfg, temperature=1.0, pad_token_id=0, ref_model=reference)
    update.add(batch["g0"])
    assert all(p.grad is not None for p in parts.parameters())  # the part's backward ran when it came
    assert all(torch.equal(p, b) for p, b in zip(parts.parameters(), before))  # ... and no step yet
    update.add(batch["g1"])  # no variance: filtered, nothing to run
    update.add(batch["g2"])
    parts_stats = update.finish()

    for p, q, b in zip(parts.parameters(), whole.parameters(), before):
        assert not torch.equal(p, b)
        assert torch.allclose(p, q, atol=1e-6)
    assert parts_stats.keys() == whole_stats.keys()
    for key, value in whole_stats.items():
        assert parts_stats[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert parts_stats["trained_trajectories"] == 8 and parts_stats["zero_variance_group_fraction"] == 1 / 3


def test_a_batch_of_only_flat_groups_skips_the_step(tiny_dir):
    model = load_model(tiny_dir)
    before = [p.detach().clone() for p in model.parameters()]
    update = StreamedUpdate(model, *sgd(model), PPOConfig(), temperature=1.0, pad_token_id=0)
    update.add(groups()["g1"])
    stats = update.finish()
    assert stats["skipped"] == 1.0 and stats["trained_trajectories"] == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("field, value", [("ppo_epochs", 2), ("num_minibatches", 2), ("advantage", "gae")])
def test_more_than_one_step_or_a_critic_is_refused_by_name(tiny_dir, field, value):
    model = load_model(tiny_dir)
    with pytest.raises(ValueError, match=field):
        StreamedUpdate(model, *sgd(model), PPOConfig(**{field: value}), temperature=1.0, pad_token_id=0)


def test_policy_parts_in_its_trainer_thread_equal_one_update(tiny_dir):
    """`Policy.update_part` + `finish_update` (what the recipe streams) against `Policy.update`, with AdamW;
    a policy given no part takes no step and says so."""
    cfg = TrainConfig()
    cfg.model.path = str(tiny_dir)
    batch = groups()

    async def run():
        spec = TrainSpec.of(cfg, pad_token_id=0)
        whole = load_trainable("policy", spec, str(tiny_dir), str(tiny_dir))
        parts = load_trainable("policy", spec, str(tiny_dir), str(tiny_dir))
        idle = load_trainable("policy", spec, str(tiny_dir), str(tiny_dir))
        gens = [torch.Generator().manual_seed(0) for _ in range(3)]
        await whole.update([t for g in batch.values() for t in g], gens[0])
        for g in batch.values():
            await parts.update_part(g)
        await parts.finish_update(gens[1])
        idle_stats = await idle.finish_update(gens[2])
        for p in (whole, parts, idle):
            p.close()
        return whole, parts, idle, idle_stats, gens

    whole, parts, idle, idle_stats, gens = asyncio.run(run())
    for p, q in zip(parts.model.parameters(), whole.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    assert torch.equal(gens[0].get_state(), gens[1].get_state())  # the same draws as an unstreamed update
    assert idle_stats["skipped"] == 1.0 and parts.optimizer.state and not idle.optimizer.state
