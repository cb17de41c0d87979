import json
import warnings

import pytest
from gymnasium.utils.env_checker import check_env

from areal_agents.envs.dataset_env import DatasetEnv
from areal_agents.envs.multi_agent import MultiAgentTextEnv, check_multi_agent_env

ROWS = [{"prompt": "2+2?", "answer": "4"}, {"prompt": "Capital of France?", "answer": "Paris"}]


def test_dataset_env_from_jsonl_is_seeded_and_checked(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    env = DatasetEnv(path, max_turns=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*not having a spec")  # made directly, not by gymnasium.make
        check_env(env)
    assert [env.reset(seed=s)[1]["index"] for s in range(10)] == [env.reset(seed=s)[1]["index"] for s in range(10)]
    obs, info = env.reset(options={"index": 1})
    assert obs == "Capital of France?" and info["index"] == 1
    assert env.step("Lyon")[:3] == ("That is not correct. Try again.", 0.0, False)
    assert env.step(" Paris ")[1:3] == (1.0, True)


def test_dataset_env_errors_name_the_problem():
    with pytest.raises(ValueError, match="key 'question'"):
        DatasetEnv(ROWS, prompt_key="question")
    with pytest.raises(ValueError, match=r"options\['index'\]"):
        DatasetEnv(ROWS).reset(options={"index": 7})


class Guess(MultiAgentTextEnv):
    possible_agents = ["alice", "bob"]

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.secret = str(int(self.np_random.integers(10)))
        return {a: "Guess a digit." for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        acting, self.agents = list(self.agents), []
        rewards = {a: float(actions[a].strip() == self.secret) for a in acting}
        done = {a: True for a in acting}
        return {a: "" for a in acting}, rewards, done, {a: False for a in acting}, {a: {} for a in acting}


class WrongKeys(Guess):
    def step(self, actions):
        obs, rewards, done, trunc, infos = super().step(actions)
        return obs, {"alice": 0.0}, done, trunc, infos


def test_multi_agent_checker_accepts_a_correct_env_and_names_mistakes():
    check_multi_agent_env(Guess())
    with pytest.raises(AssertionError, match=r"step\(\) rewards keys \['alice', 'bob'\], got \['alice'\]"):
        check_multi_agent_env(WrongKeys())


def test_a_multi_agent_env_without_step_cannot_be_made():
    class NoStep(MultiAgentTextEnv):
        possible_agents = ["a"]

    with pytest.raises(TypeError, match="abstract method 'step'|abstract methods? step"):
        NoStep()
