import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import areal_agents  # noqa: F401  (registers the ids)
from areal_agents.envs import make_env
from areal_agents.envs.count import Count, CountEnv, sample_count
from areal_agents.errors import ArealAgentsError


@pytest.mark.parametrize("kwargs", [{}, {"split": "test"}, {"median_length": 3, "max_length": 5, "start_below": 7}])
def test_check_env_passes_without_warnings(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(gym.make("areal_agents/Count-v0", **kwargs).unwrapped)


def test_exact_count_gets_reward_one_and_spacing_is_forgiven():
    env = CountEnv()
    obs, _ = env.reset(seed=3)
    c = env.count
    assert obs == f"count {c.first}..{c.last}="
    _, reward, terminated, truncated, info = env.step("  " + "  ".join(map(str, range(c.first, c.last + 1))) + "\n")
    assert (reward, terminated, truncated, info["correct"], info["length"]) == (
        1.0,
        True,
        False,
        True,
        c.last - c.first + 1,
    )


def test_stopping_early_or_late_gets_nothing():
    env = CountEnv()
    env.reset(seed=0)
    c = env.count
    assert env.step(" ".join(map(str, range(c.first, c.last + 2))))[1] == 0.0
    env.reset(seed=0)
    assert env.step(" ".join(map(str, range(c.first, c.last))))[1] == 0.0


def test_lengths_are_long_tailed_and_capped():
    rng = np.random.default_rng(0)
    lengths = np.array([(lambda c: c.last - c.first + 1)(sample_count(rng, 100, 6, 0.8, 32)) for _ in range(4000)])
    assert np.median(lengths) == 6 and lengths.min() == 1 and lengths.max() == 32
    assert lengths.mean() > np.median(lengths) and np.percentile(lengths, 99) > 4 * np.median(lengths)


def test_train_and_test_splits_are_disjoint_and_seeded():
    train = {CountEnv(split="train").reset(seed=s)[0] for s in range(300)}
    test = {CountEnv(split="test").reset(seed=s)[0] for s in range(300)}
    assert train and test and not train & test
    assert all(Count(*map(int, t[6:-1].split(".."))).split == "test" for t in test)
    assert [CountEnv().reset(seed=s)[0] for s in range(10)] == [CountEnv().reset(seed=s)[0] for s in range(10)]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_length": 0}, "max_length"),
        ({"median_length": 40}, "median_length"),
        ({"sigma": -1}, "sigma"),
        ({"start_below": 0}, "start_below"),
        ({"split": "dev"}, "split"),
    ],
)
def test_bad_kwargs_name_the_field(kwargs, field):
    with pytest.raises(ArealAgentsError, match=field):
        make_env("areal_agents/Count-v0", **kwargs)


def test_step_before_reset_is_an_error():
    with pytest.raises(RuntimeError, match="reset"):
        CountEnv().step("1")
