"""GAE and the critic: hand-computed advantages, the clipped value loss, and a PPO step that trains both."""

import pytest
import torch

from areal_agents.config import PPOConfig
from areal_agents.trainers.batching import make_micro_batches
from areal_agents.trainers.critic import ValueModel, gae, value_loss, whiten
from areal_agents.trainers.optim import make_optimizer
from areal_agents.trainers.ppo import critic_values, ppo_update
from areal_agents.types import Trajectory


def test_gae_by_hand_skips_env_tokens():
    # tokens: prompt, gen, gen, env, gen  -> the time axis is the three generated tokens (1, 2, 4)
    values = torch.tensor([9.0, 0.5, 0.25, 9.0, 0.75])
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    adv, ret = gae(values, mask, reward=1.0, gamma=0.9, lam=0.5)
    d4 = 1.0 - 0.75  # last token: reward, no next value
    d2 = 0.9 * 0.75 - 0.25
    d1 = 0.9 * 0.25 - 0.5
    a4 = d4
    a2 = d2 + 0.9 * 0.5 * a4
    a1 = d1 + 0.9 * 0.5 * a2
    assert adv.tolist() == pytest.approx([0.0, a1, a2, 0.0, a4])
    assert ret.tolist() == pytest.approx([0.0, a1 + 0.5, a2 + 0.25, 0.0, a4 + 0.75])


def test_gae_with_gamma_lambda_one_is_reward_minus_value():
    values = torch.tensor([0.0, 0.2, 0.4, 0.6])
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0])
    adv, ret = gae(values, mask, reward=2.0, gamma=1.0, lam=1.0)
    assert adv.tolist() == pytest.approx([0.0, 1.8, 1.6, 1.4])
    assert ret.tolist() == pytest.approx([0.0, 2.0, 2.0, 2.0])  # every token's return is the episode reward


def test_whiten_over_loss_tokens_only():
    a = [torch.tensor([5.0, 1.0, 3.0]), torch.tensor([7.0, 5.0])]
    m = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0])]
    out = whiten(a, m)
    flat = torch.cat([x[k.bool()] for x, k in zip(out, m)])
    assert float(flat.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(flat.std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)
    assert out[0][0] == 0 and out[1][0] == 0


def test_value_loss_clips_large_moves():
    old = torch.tensor([0.0, 0.0])
    new = torch.tensor([1.0, 0.1])
    ret = torch.tensor([1.0, 1.0])
    mask = torch.tensor([1.0, 1.0])
    loss, frac = value_loss(new, old, ret, mask, value_clip=0.2, num_tokens=2)
    # token 0 moved 1.0 > 0.2: the clipped value 0.2 has error 0.64 > 0; token 1 within the clip: 0.81
    assert float(loss) == pytest.approx(0.5 * (0.64 + 0.81) / 2)
    assert frac == pytest.approx(0.5)
    loss, _ = value_loss(new, old, ret, mask, value_clip=None, num_tokens=2)
    assert float(loss) == pytest.approx(0.5 * (0.0 + 0.81) / 2)


def _trajs():
    return [
        Trajectory([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 0, 1], [0, 0, -3.0, -3.0, 0, -3.0], [-1, -1, 0, 0, -1, 0], r, "g")
        for r in (0.0, 1.0)
    ] + [Trajectory([5, 6, 11], [0, 0, 1], [0, 0, -3.0], [-1, -1, 0], 1.0, "h")]


def test_value_model_packed_equals_padded(tiny_dir):
    from areal_agents.models import load_model

    critic = ValueModel(load_model(tiny_dir)).eval()
    torch.nn.init.normal_(critic.head.weight)
    padded = critic_values(critic, _trajs(), 1024, pad=0, pack=False)
    packed = critic_values(critic, _trajs(), 1024, pad=0, pack=True)
    for a, b in zip(padded, packed):
        assert torch.allclose(a, b, atol=1e-5)
        assert a[0] == 0.0


def test_ppo_step_with_gae_trains_policy_and_critic(model, tiny_dir):
    from areal_agents.models import load_model

    critic = ValueModel(load_model(tiny_dir))
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0)
    before_policy = [p.detach().clone() for p in model.parameters()]
    cfg = PPOConfig(advantage="gae", gamma=1.0, lam=1.0, value_clip=None)
    stats = ppo_update(
        model, optimizer, scheduler, _trajs(), cfg, temperature=1.0, pad_token_id=0,
        critic=critic, critic_optimizer=critic_opt,
    )  # fmt: skip
    assert stats["trained_trajectories"] == 3  # no zero-variance filtering: group "h" has one member
    assert stats["value_mean"] == 0.0 and stats["return_mean"] == pytest.approx((0 + 3 * 1 + 1) / 7)
    assert stats["value_loss"] > 0 and "critic_grad_norm" in stats
    assert any(not torch.equal(a, b) for a, b in zip(before_policy, model.parameters()))
    values = critic_values(critic, _trajs(), 1024, pad=0)
    assert float(values[1][2]) > 0  # the critic moved toward the positive returns


def test_gae_without_critic_is_a_clear_error(model):
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0)
    with pytest.raises(ValueError, match="gae needs a critic"):
        ppo_update(model, optimizer, scheduler, _trajs(), PPOConfig(advantage="gae"), temperature=1.0, pad_token_id=0)


@pytest.mark.parametrize("pack", [False, True])
def test_spread_puts_each_trajectory_where_its_tokens_are(pack):
    from areal_agents.trainers.batching import spread

    trajs = _trajs()
    per = [torch.arange(len(t), dtype=torch.float) + 100 * i for i, t in enumerate(trajs)]
    for mb in make_micro_batches(trajs, 12, pad_token_id=0, pack=pack):
        laid = spread(mb, per)
        for (row, a, b), i in zip(mb.slices, mb.index):
            assert torch.equal(laid[row, a:b], per[i])
            assert torch.equal(mb.input_ids[row, a:b], torch.tensor(trajs[i].input_ids))
