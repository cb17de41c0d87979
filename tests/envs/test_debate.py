"""`areal_agents/Debate-v0`: the dict-API checks, rounds and visibility, majority vote, rewards and shaping."""

import pytest

from areal_agents.envs import check_multi_agent_env, make_env


def debate(**kwargs):
    return make_env("areal_agents/Debate-v0", task_kwargs={"digits": 1}, **kwargs)


def answer_of(env):
    return str(eval(env.question.rstrip("=")))  # the arithmetic task: "a+b="


@pytest.mark.parametrize("kwargs", [{}, {"num_agents": 3, "rounds": 3, "visibility": "ring"}, {"rounds": 1}])
def test_passes_the_multi_agent_checker(kwargs):
    check_multi_agent_env(debate(**kwargs))


def test_rounds_show_the_other_answers_then_score_the_final_ones():
    env = debate(num_agents=3, rounds=2)
    observations, infos = env.reset(seed=4)
    assert set(observations) == {"debater_0", "debater_1", "debater_2"} and len(set(observations.values())) == 1
    right = answer_of(env)
    obs, rewards, term, trunc, _ = env.step({"debater_0": right, "debater_1": "x", "debater_2": "y"})
    assert not any(term.values()) and rewards == {"debater_0": 0.0, "debater_1": 0.0, "debater_2": 0.0}
    assert f"debater_0: {right}" in obs["debater_1"] and "debater_2: y" in obs["debater_1"]
    assert "debater_1" not in obs["debater_1"]  # an agent does not see itself
    obs, rewards, term, trunc, infos = env.step({"debater_0": right, "debater_1": right, "debater_2": "y"})
    assert all(term.values()) and env.agents == []
    assert rewards == {"debater_0": 1.0, "debater_1": 1.0, "debater_2": 0.0}
    assert infos["debater_2"]["majority_answer"] == right and infos["debater_2"]["success"] is True


def test_ring_visibility_shows_the_next_agent_only():
    env = debate(num_agents=3, rounds=2, visibility="ring")
    env.reset(seed=1)
    obs, *_ = env.step({"debater_0": "1", "debater_1": "2", "debater_2": "3"})
    assert "debater_1: 2" in obs["debater_0"] and "debater_2" not in obs["debater_0"]
    assert "debater_0: 1" in obs["debater_2"]


def test_shaping_rewards():
    env = debate(num_agents=3, rounds=2, round_reward=0.25, flip_to_right_reward=0.5, right_against_majority_reward=2.0)
    env.reset(seed=7)
    right = answer_of(env)
    env.step({"debater_0": right, "debater_1": "w", "debater_2": "w"})
    _, rewards, _, _, infos = env.step({"debater_0": "w", "debater_1": right, "debater_2": "w"})
    assert infos["debater_0"]["majority_correct"] is False  # "w" wins 2 to 1
    assert rewards["debater_0"] == pytest.approx(0.25)  # right in round 1 only
    assert rewards["debater_1"] == pytest.approx(1.0 + 0.5 + 2.0)  # right at the end, flipped, against majority
    assert rewards["debater_2"] == 0.0


def test_majority_ties_go_to_the_first_agent():
    env = debate(num_agents=2, rounds=1)
    env.reset(seed=2)
    *_, infos = env.step({"debater_0": "a", "debater_1": "b"})
    assert infos["debater_0"]["majority_answer"] == "a"


def test_the_task_seed_fixes_the_question():
    env = debate()
    first = env.reset(seed=11)[0]["debater_0"]
    assert env.reset(seed=11)[0]["debater_0"] == first
    task = make_env("areal_agents/Arithmetic-v0", digits=1)
    assert task.reset(seed=11)[0] == first  # the debate's question is the task env's, same seed


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_agents": 1}, "num_agents"),
        ({"num_agents": 100_000}, r"num_agents: expects an int in \[2, 16\]"),  # a client sizes each step by it
        ({"max_answer_chars": 10**9}, "max_answer_chars"),
        ({"rounds": 0}, "rounds"),
        ({"visibility": "some"}, "visibility"),
        ({"round_prompt": "no placeholder"}, "round_prompt"),
        ({"task_env": "areal_agents/Nope-v0"}, "Nope-v0"),
    ],
)
def test_bad_config_names_the_field(kwargs, message):
    with pytest.raises(Exception, match=message):
        debate(**kwargs)
