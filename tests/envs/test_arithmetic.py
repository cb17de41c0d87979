import warnings

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import areal_agents  # noqa: F401  (registers the ids)
from areal_agents.envs import make_env
from areal_agents.envs.arithmetic import ArithmeticEnv
from areal_agents.errors import ArealAgentsError, UnknownEnvError


@pytest.mark.parametrize(
    "env_id, kwargs",
    [
        ("areal_agents/Arithmetic-v0", {}),
        ("areal_agents/Arithmetic-v0", {"max_turns": 3, "operators": "+-*", "digits": 3}),
        ("areal_agents/Arithmetic-v0", {"split": "test"}),
        ("areal_agents_testing/Echo-v0", {}),
        ("areal_agents_testing/Faulty-v0", {}),
        ("areal_agents_testing/Slow-v0", {"step_seconds": 0.0}),
    ],
)
def test_check_env_passes_without_warnings(env_id, kwargs):
    import areal_agents.envs.testing  # noqa: F401

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(gym.make(env_id, **kwargs).unwrapped)


def test_seeded_and_reproducible():
    a, b = ArithmeticEnv(operators="+-*"), ArithmeticEnv(operators="+-*")
    assert [a.reset(seed=s)[0] for s in range(20)] == [b.reset(seed=s)[0] for s in range(20)]
    assert len({a.reset(seed=s)[0] for s in range(20)}) > 10


def test_exact_answer_gets_reward_one():
    env = ArithmeticEnv()
    obs, _ = env.reset(seed=3)
    answer = env.problem.answer
    assert obs == f"{env.problem.a}+{env.problem.b}="
    _, reward, terminated, truncated, info = env.step(f" {answer}\n")
    assert (reward, terminated, truncated, info["correct"]) == (1.0, True, False, True)


def test_multi_turn_feedback_then_success():
    env = ArithmeticEnv(max_turns=3)
    obs, _ = env.reset(seed=0)
    obs2, reward, terminated, _, _ = env.step("wrong")
    assert (reward, terminated) == (0.0, False) and obs2 == f"Wrong. Try again: {obs}"
    _, reward, terminated, _, info = env.step(str(env.problem.answer))
    assert (reward, terminated, info["turn"]) == (1.0, True, 2)


def test_last_wrong_try_ends_the_episode():
    env = ArithmeticEnv(max_turns=2)
    env.reset(seed=0)
    env.step("x")
    _, reward, terminated, _, _ = env.step("y")
    assert (reward, terminated) == (0.0, True)


def test_train_and_test_splits_are_disjoint():
    train, test = ArithmeticEnv(split="train"), ArithmeticEnv(split="test")
    train_set = {train.reset(seed=s)[0] for s in range(2000)}
    test_set = {test.reset(seed=s)[0] for s in range(300)}
    assert train_set.isdisjoint(test_set) and len(test_set) > 100


def test_bad_arguments_and_unknown_id():
    with pytest.raises(ValueError, match="operators"):
        ArithmeticEnv(operators="/")
    with pytest.raises(ArealAgentsError, match="digits"):
        make_env("areal_agents/Arithmetic-v0", digits=0)
    with pytest.raises(UnknownEnvError, match="Did you mean 'areal_agents/Arithmetic-v0'"):
        make_env("areal_agents/Arithmetik-v0")
