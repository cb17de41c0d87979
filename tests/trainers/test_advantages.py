import math

import pytest

from areal_agents.trainers.advantages import group_advantages, zero_variance_groups


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
