import math

import pytest
import torch

from areal_agents.trainers.ppo_loss import decoupled_ppo_loss, kl_to_reference, mismatch_stats, sequence_ratio_mask


def loss_of(logp, prox, behav, adv, mask=None, **kw):
    logp = torch.tensor(logp, requires_grad=True)
    mask = torch.ones_like(logp) if mask is None else torch.tensor(mask, dtype=torch.float)
    loss, stats = decoupled_ppo_loss(logp, torch.tensor(prox), torch.tensor(behav), torch.tensor(adv), mask, **kw)
    loss.backward()
    return loss.item(), logp.grad, stats


def test_ratio_one_no_cap_is_plain_policy_gradient():
    # π_θ = π_prox = π_behav: ratio 1, weight 1, so L = -mean(A) and dL/dlogp_t = -A_t / N.
    lp = [-0.5, -1.0, -2.0]
    adv = [1.0, -2.0, 0.5]
    loss, grad, stats = loss_of(lp, lp, lp, adv)
    assert loss == pytest.approx(-(1.0 - 2.0 + 0.5) / 3)
    assert torch.allclose(grad, -torch.tensor(adv) / 3)
    assert stats["clip_fraction"] == 0.0 and stats["capped_fraction"] == 0.0


def test_clipping_above_for_positive_advantage():
    # ratio = e^{ln 1.5} = 1.5 > 1.2 with A = 2: loss = -2 * 1.2 = -2.4, gradient zero (clipped).
    loss, grad, stats = loss_of([math.log(1.5)], [0.0], [0.0], [2.0], eps_clip=0.2)
    assert loss == pytest.approx(-2.4)
    assert grad.abs().sum() == 0
    assert stats["clip_fraction"] == 1.0


def test_clipping_below_for_negative_advantage():
    # ratio 0.5 < 0.8 with A = -1: max(0.5, 0.8) = 0.8 is the clipped branch, gradient zero.
    loss, grad, stats = loss_of([math.log(0.5)], [0.0], [0.0], [-1.0], eps_clip=0.2)
    assert loss == pytest.approx(0.8)
    assert grad.abs().sum() == 0
    assert stats["clip_fraction"] == 1.0


def test_no_clipping_when_ratio_moves_against_advantage():
    # ratio 0.5 with A = +1: max(-0.5, -0.8) = -0.5 is unclipped; dL/dlogp = -A * ratio = -0.5.
    loss, grad, stats = loss_of([math.log(0.5)], [0.0], [0.0], [1.0], eps_clip=0.2)
    assert loss == pytest.approx(-0.5)
    assert grad.item() == pytest.approx(-0.5)
    assert stats["clip_fraction"] == 0.0


def test_clip_higher_widens_upper_bound_only():
    # eps_clip_higher 0.28: ratio 1.5 clipped to 1.28 for A > 0.
    loss, _, _ = loss_of([math.log(1.5)], [0.0], [0.0], [1.0], eps_clip=0.2, eps_clip_higher=0.28)
    assert loss == pytest.approx(-1.28)


def test_dual_clip_bounds_negative_advantage_loss():
    # ratio 5 with A = -1: PPO loss max(5, 1.2) = 5; dual clip c = 3 bounds it to 3.
    loss, grad, stats = loss_of([math.log(5.0)], [0.0], [0.0], [-1.0], eps_clip=0.2, dual_clip=3.0)
    assert loss == pytest.approx(3.0)
    assert grad.abs().sum() == 0
    assert stats["dual_clip_fraction"] == 1.0


def test_behavior_weight_multiplies_loss():
    # logp_prox - logp_behav = ln 2: w = 2, ratio 1, A = 1 -> loss = -2.
    loss, grad, stats = loss_of([0.0], [0.0], [-math.log(2.0)], [1.0], behav_imp_weight_cap=5.0)
    assert loss == pytest.approx(-2.0)
    assert grad.item() == pytest.approx(-2.0)
    assert stats["behav_weight_mean"] == pytest.approx(2.0)


def test_cap_masks_tokens_beyond_it():
    # Token 0: w = 2 (kept); token 1: w = 10 > cap 5 (masked). N stays 2 (all loss tokens).
    loss, grad, stats = loss_of(
        [0.0, 0.0], [0.0, 0.0], [-math.log(2.0), -math.log(10.0)], [1.0, 1.0], behav_imp_weight_cap=5.0
    )
    assert loss == pytest.approx(-2.0 / 2)
    assert grad[1].item() == 0.0 and grad[0].item() == pytest.approx(-1.0)
    assert stats["capped_fraction"] == pytest.approx(0.5)
    assert stats["behav_weight_max"] == pytest.approx(10.0)


def test_cap_clamp_mode_keeps_tokens_at_the_cap():
    # Same tokens as above, clamp mode: token 1 counts with w = 5 instead of being dropped.
    loss, grad, stats = loss_of(
        [0.0, 0.0],
        [0.0, 0.0],
        [-math.log(2.0), -math.log(10.0)],
        [1.0, 1.0],
        behav_imp_weight_cap=5.0,
        behav_imp_weight_mode="clamp",
    )
    assert loss == pytest.approx(-(2.0 + 5.0) / 2)
    assert grad[1].item() == pytest.approx(-2.5)
    assert stats["capped_fraction"] == pytest.approx(0.5)


def test_loss_mask_and_shared_token_count():
    # Masked tokens contribute nothing; num_tokens overrides the normaliser (micro-batch accumulation).
    loss, grad, _ = loss_of([0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 5.0], mask=[1, 0], num_tokens=4)
    assert loss == pytest.approx(-1.0 / 4)
    assert grad[1].item() == 0.0


def test_kl_to_reference_k3_estimator():
    logp = torch.tensor([math.log(0.5), math.log(0.25), -1.0])
    mask = torch.tensor([1.0, 1.0, 0.0])
    penalty, mean = kl_to_reference(logp, logp.clone(), mask)
    assert float(penalty) == 0.0 and mean == 0.0  # same policy: no penalty
    ref = torch.tensor([math.log(0.25), math.log(0.5), 5.0])
    penalty, mean = kl_to_reference(logp, ref, mask)
    expected = ((0.5 - math.log(0.5) - 1) + (2 - math.log(2) - 1)) / 2  # exp(d) - d - 1, d = ref - logp
    assert float(penalty) == pytest.approx(expected) and mean == pytest.approx(expected)


def test_ppo_update_adds_the_kl_penalty_to_a_reference(model, tiny_dir):
    from areal_agents.config import PPOConfig
    from areal_agents.models import load_model
    from areal_agents.trainers.optim import make_optimizer
    from areal_agents.trainers.ppo import ppo_update
    from areal_agents.types import Trajectory

    reference = load_model(tiny_dir)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.1 * torch.randn_like(p))
    trajs = [
        Trajectory(
            [5, 6, 7, 8, 9], [0, 0, 1, 1, 1], [0.0, 0.0, -3.0, -3.0, -3.0], [-1, -1, 0, 0, 0], reward=r, group_id="g"
        )
        for r in (0.0, 1.0)
    ]
    stats = {}
    for coef in (0.0, 0.5):
        optimizer, scheduler = make_optimizer(model, 1e-4, 0.0, 0)
        cfg = PPOConfig(kl_coef=coef, filter_zero_variance_groups=False)
        stats[coef] = ppo_update(
            model, optimizer, scheduler, trajs, cfg, temperature=1.0, pad_token_id=0, ref_model=reference
        )
    assert stats[0.0]["kl_ref"] == 0.0  # not computed without a coefficient
    assert stats[0.5]["kl_ref"] > 0.0  # the perturbed reference is measurably away from the policy


def test_one_step_update_equals_the_explicit_proximal_recompute(tiny_dir):
    """With one optimizer step per batch the trainer skips the proximal pass; the gradient is the same as
    with π_prox recomputed explicitly."""
    from areal_agents.config import PPOConfig
    from areal_agents.models import load_model
    from areal_agents.trainers.batching import make_micro_batches, token_logprobs
    from areal_agents.trainers.ppo import ppo_update, proximal_logprobs
    from areal_agents.types import Trajectory

    trajs = [
        Trajectory([5, 6, 7, 8, 9], [0, 0, 1, 1, 1], [0.0, 0.0, -3.0, -4.0, -3.5], [-1, -1, 0, 0, 0], r, group_id="g")
        for r in (0.0, 1.0)
    ]
    cfg = PPOConfig(filter_zero_variance_groups=False, max_grad_norm=1e9)

    explicit = load_model(tiny_dir)
    prox = proximal_logprobs(explicit, trajs, 1.0, 1024, 0)
    (mb,) = make_micro_batches(trajs, 1024, [-1.0, 1.0], 0, prox)
    loss, _ = decoupled_ppo_loss(
        token_logprobs(explicit, mb), mb.prox_logprobs, mb.logprobs, mb.advantages, mb.loss_mask,
        behav_imp_weight_cap=cfg.behav_imp_weight_cap,
    )  # fmt: skip
    loss.backward()

    skipped = load_model(tiny_dir)
    before = [p.detach().clone() for p in skipped.parameters()]
    sgd = torch.optim.SGD(skipped.parameters(), lr=1.0)
    ppo_update(
        skipped, sgd, torch.optim.lr_scheduler.LambdaLR(sgd, lambda _: 1.0), trajs, cfg, temperature=1.0, pad_token_id=0
    )
    for p, b, q in zip(skipped.parameters(), before, explicit.parameters()):
        assert torch.allclose(b - p.detach(), q.grad, atol=1e-6)


def test_mismatch_stats_are_k3_sums_over_the_fresh_tokens_only():
    train = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    behav = torch.tensor([[-1.0, -2.5, -0.5, -1.0]])
    fresh = torch.tensor([[1.0, 1.0, 0.0, 0.0]])  # the last two: another version's tokens, not counted
    st = mismatch_stats(train, behav, fresh)
    d = 0.5  # log π_train - log π_behav of the second token
    assert st["mismatch_tokens"] == 2.0
    assert st["mismatch_kl_sum"] == pytest.approx(math.exp(d) - 1.0 - d)
    assert st["mismatch_max_abs"] == pytest.approx(0.5)
    assert mismatch_stats(train, train, torch.ones_like(train))["mismatch_kl_sum"] == 0.0
    assert mismatch_stats(train, behav, torch.zeros_like(train)) == {
        "mismatch_kl_sum": 0.0, "mismatch_tokens": 0.0, "mismatch_max_abs": 0.0,
    }  # fmt: skip


def test_sequence_ratio_mask_drops_whole_trajectories_outside_the_band():
    # two trajectories packed in one row: [0:3] with log-ratios 0, 0.2, 0.1 (mean 0.1 -> ratio 1.105) and
    # [3:6] with -1, -1 on its two loss tokens (ratio 0.37); a third in row 1 without loss tokens
    log_ratio = torch.tensor([[0.0, 0.2, 0.1, 9.0, -1.0, -1.0], [5.0] * 6])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0, 1.0], [0.0] * 6])
    slices = [(0, 0, 3), (0, 3, 6), (1, 0, 6)]
    out = sequence_ratio_mask(log_ratio, mask, slices, 0.5, 2.0)
    assert out.tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0, 0.0], [0.0] * 6]
    assert torch.equal(
        sequence_ratio_mask(log_ratio, mask, slices, None, 1.05), torch.tensor([[0.0] * 4 + [1.0] * 2, [0.0] * 6])
    )
    assert torch.equal(sequence_ratio_mask(log_ratio, mask, slices, None, None), mask)
