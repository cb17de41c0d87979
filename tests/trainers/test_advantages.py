import math

import pytest

from areal_agents.trainers.advantages import group_advantages, shape_rewards, zero_variance_groups


def test_grpo_normalises_within_each_group():
    # Group a: [1, 0, 0, 0]: mean 0.25, population std sqrt(0.1875) = 0.4330.
    adv = group_advantages([1, 0, 0, 0, 5, 5], ["a", "a", "a", "a", "b", "b"], "grpo")
    std = math.sqrt(0.1875)
    assert adv[0].item() == pytest.approx(0.75 / std, rel=1e-4)
    assert adv[1].item() == pytest.approx(-0.25 / std, rel=1e-4)
    assert adv[4].item() == 0.0 and adv[5].item() == 0.0  # no variance, no signal


def test_rloo_uses_leave_one_out_mean():
    adv = group_advantages([1, 0, 0, 0], ["a"] * 4, "rloo")
    assert adv.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


def test_zero_variance_groups():
    assert zero_variance_groups([1, 1, 0, 1], ["a", "a", "b", "b"]) == {"a"}


def test_unknown_method_is_an_error():
    with pytest.raises(ValueError, match="grpo"):
        group_advantages([1.0], ["a"], "ppo")


def test_dr_grpo_centres_without_dividing_by_the_std():
    adv = group_advantages([1, 0, 0, 0, 5, 5], ["a", "a", "a", "a", "b", "b"], "dr_grpo")
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.0, 0.0])


def test_reward_shaping_bias_scale_clip():
    assert shape_rewards([1.0, 0.0, 3.0], scale=2.0, bias=-0.5) == [1.0, -1.0, 5.0]
    assert shape_rewards([1.0, 0.0, 3.0], scale=2.0, bias=-0.5, clip=2.0) == [1.0, -1.0, 2.0]
