"""The one PPO update path: a streamed batch (loss sums, gradients divided at the step) takes the step of
the whole batch (loss normalised up front) in every layout; what `prepare_batch` hands the critic."""

import random

import pytest
import torch

from areal_agents.config import PPOConfig
from areal_agents.models import load_model
from areal_agents.trainers.critic import ValueModel, critic_values, gae
from areal_agents.trainers.ppo import StreamedUpdate, ppo_update
from areal_agents.trainers.ppo_batch import prepare_batch
from areal_agents.types import Trajectory


def _groups(n_groups: int = 3, seed: int = 0) -> list[list[Trajectory]]:
    """Groups of 4 sharing a prompt; mixed lengths, rewards and behavior logprobs (group 1 is flat)."""
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(4, 90) for _ in range(rng.choice([2, 3, 6]))]
        group = []
        for k in range(4):
            n = rng.choice([1, 4, 9])
            group.append(
                Trajectory(
                    prompt + [rng.randrange(4, 90) for _ in range(n)],
                    [0] * len(prompt) + [1] * n,
                    [0.0] * len(prompt) + [rng.uniform(-5.0, -1.0) for _ in range(n)],
                    [-1] * len(prompt) + [0] * n,
                    reward=1.0 if g == 1 else float(rng.random() < 0.5) + 0.1 * k,
                    group_id=f"g{g}",
                    episode_id=f"g{g}/e{k}",
                )
            )
        out.append(group)
    return out


def _sgd(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


@pytest.mark.parametrize(
    "layout",
    [
        dict(packing=False),
        dict(packing=True, share_prompts=False),
        dict(packing=True, share_prompts=True, micro_batch_tokens=24),  # several micro-batches per part
        dict(dual_clip=2.0, behav_imp_weight_cap=3.0, eps_clip_higher=0.28),
    ],
)
def test_streamed_parts_equal_the_whole_batch_in_every_layout(tiny_dir, layout):
    cfg = PPOConfig(max_grad_norm=1e9, **layout)
    batch = _groups()
    whole = load_model(tiny_dir)
    gens = [torch.Generator().manual_seed(4) for _ in range(2)]
    whole_stats = ppo_update(
        whole, *_sgd(whole), [t for g in batch for t in g], cfg, temperature=0.8, pad_token_id=0, generator=gens[0]
    )
    parts = load_model(tiny_dir)
    update = StreamedUpdate(parts, *_sgd(parts), cfg, temperature=0.8, pad_token_id=0)
    for group in batch:
        update.add(group)
    parts_stats = update.finish(gens[1])
    for p, q in zip(parts.parameters(), whole.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    assert torch.equal(gens[0].get_state(), gens[1].get_state())
    assert parts_stats.keys() == whole_stats.keys()
    for key, value in whole_stats.items():
        assert parts_stats[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_a_skipped_batch_reports_the_same_keys_either_way(tiny_dir):
    flat = _groups()[1]  # one reward for all: no signal
    model = load_model(tiny_dir)
    before = [p.detach().clone() for p in model.parameters()]
    whole = ppo_update(model, *_sgd(model), flat, PPOConfig(), temperature=1.0, pad_token_id=0)
    update = StreamedUpdate(model, *_sgd(model), PPOConfig(), temperature=1.0, pad_token_id=0)
    update.add(flat)
    streamed = update.finish()
    assert whole == streamed
    assert whole["skipped"] == 1.0 and whole["zero_variance_group_fraction"] == 1.0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_prepare_batch_gives_the_critic_gae_of_its_own_values(tiny_dir):
    """GAE keeps every trajectory (flat groups too); advantages and returns are `gae` of the critic's
    values, trajectory by trajectory; π_prox is scored only when the update takes several steps."""
    cfg = PPOConfig(advantage="gae", gamma=0.9, lam=0.8, whiten_advantages=False, reward_scale=2.0)
    trajs = [t for g in _groups() for t in g]
    critic = ValueModel(load_model(tiny_dir))
    with torch.no_grad():
        critic.head.bias.fill_(0.3)  # values that are not all 0
    model = load_model(tiny_dir)
    batch = prepare_batch(model, trajs, cfg, temperature=1.0, pad_token_id=0, critic=critic)
    assert batch.trajectories == trajs and batch.prox is None
    values = critic_values(critic, trajs, cfg.micro_batch_tokens, 0, cfg.packing, None, cfg.share_prompts)
    for t, v, old, adv, ret in zip(trajs, values, batch.old_values, batch.advantages, batch.returns):
        expected_adv, expected_ret = gae(v, torch.tensor(t.loss_mask, dtype=torch.float), 2.0 * t.reward, 0.9, 0.8)
        assert torch.allclose(old, v) and torch.allclose(adv, expected_adv) and torch.allclose(ret, expected_ret)
    several = prepare_batch(
        model, trajs, PPOConfig(advantage="gae", ppo_epochs=2), temperature=1.0, pad_token_id=0, critic=critic
    )
    assert several.prox is not None and [len(p) for p in several.prox] == [len(t) for t in trajs]


def test_baseline_advantage_is_each_reward_less_the_baseline_it_carries(tiny_dir):
    """ppo.advantage=baseline (gateway sessions, no groups): A = shaped reward - shaped baseline, on every loss
    token; a trajectory at its baseline carries no gradient and is left out; a missing baseline is named."""
    trajs = [t for g in _groups() for t in g][:6]
    for k, t in enumerate(trajs):
        t.group_id, t.metadata = f"session{k}", {"baseline": 0.5 if k else t.reward}
    cfg = PPOConfig(advantage="baseline", reward_scale=2.0, reward_bias=0.1)
    batch = prepare_batch(load_model(tiny_dir), trajs, cfg, temperature=1.0, pad_token_id=0)
    assert batch.trajectories == trajs[1:] and batch.counts["flat_groups"] == 1.0
    for t, adv in zip(trajs[1:], batch.advantages):
        expected = (t.reward + 0.1) * 2.0 - (0.5 + 0.1) * 2.0
        assert torch.allclose(adv, expected * torch.tensor(t.loss_mask, dtype=torch.float))
    trajs[2].metadata = {}
    with pytest.raises(ValueError, match=r"metadata\['baseline'\]"):
        prepare_batch(load_model(tiny_dir), trajs, cfg, temperature=1.0, pad_token_id=0)
