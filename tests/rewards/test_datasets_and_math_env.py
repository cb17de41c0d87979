import json
import warnings
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import areal_agents  # noqa: F401
from areal_agents.data import BaseDataset, load_task_dataset
from areal_agents.data.base import raw_rows
from areal_agents.errors import ArealAgentsError
from areal_agents.rewards.math_verifier import MathVerifyConfig


def test_jsonl_dataset_rows_have_id_and_prompt(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    ds = load_task_dataset(str(path), prompt_key="problem")
    assert ds[0] == {"problem": "1+1?", "answer": "2", "id": "0", "prompt": "1+1?"}
    with pytest.raises(ArealAgentsError, match="no key 'question'"):
        load_task_dataset(str(path), prompt_key="question")


def test_hf_id_without_datasets_package_is_a_clear_error():
    with pytest.raises(ArealAgentsError, match="Hugging Face|datasets"):
        load_task_dataset("someone/some-dataset-that-is-not-a-file")


class Upper(BaseDataset):
    def to_row(self, index, raw):
        row = super().to_row(index, raw)
        return {**row, "prompt": row["prompt"].upper()}


def test_subclass_reshapes_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "id": "a"}) + "\n")
    assert load_task_dataset(str(path), cls=Upper)[0]["prompt"] == "HI"


@pytest.mark.process
def test_math_env_single_and_multi_turn():
    env = gym.make("areal_agents/Math-v0", dataset="aime24", max_turns=2, turn_discount=0.5)
    obs, info = env.reset(seed=1)
    answer = env.unwrapped.row["answer"]
    assert env.unwrapped.row["problem"] in obs and obs.endswith("within \\boxed{}.")
    obs, reward, terminated, _, step_info = env.step("\\boxed{-1}")
    assert (reward, terminated) == (0.0, False) and obs.startswith("Your answer is incorrect")
    _, reward, terminated, _, step_info = env.step(f"Thus \\boxed{{{answer}}}.")
    assert (reward, terminated, step_info["correct"]) == (0.5, True, True)

    single = gym.make("areal_agents/Math-v0", dataset="math500", format_reward=0.1)
    single.reset(options={"index": 0})
    gold = single.unwrapped.row["answer"]
    assert single.step(f"The answer is $\\boxed{{{gold}}}$")[1] == pytest.approx(1.1)


@pytest.mark.process
def test_math_env_passes_check_env():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(gym.make("areal_agents/Math-v0", dataset="aime25", reward_mode="inline").unwrapped)


def test_math_env_pickles_small_and_restores():
    import pickle

    env = gym.make("areal_agents/Math-v0", dataset="math500")
    env.reset(seed=3)
    blob = pickle.dumps(env)
    assert len(blob) < 20_000  # the 500 rows stay behind
    restored = pickle.loads(blob)
    assert len(restored.unwrapped.data) == 500 and restored.unwrapped.row == env.unwrapped.row


def test_reward_and_dataset_class_named_from_config(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    env = gym.make(
        "areal_agents/Math-v0",
        dataset="aime24",
        reward="user_plugins:LengthReward",
        dataset_class="user_plugins:Shouting",
        reward_mode="inline",
    )
    obs, _ = env.reset(seed=0)
    assert env.unwrapped.row["prompt"].isupper() or not any(c.isalpha() for c in env.unwrapped.row["prompt"])
    assert env.step("12")[1] == 1.0
    with pytest.raises(ArealAgentsError, match="has no attribute 'Nope'"):
        gym.make("areal_agents/Math-v0", dataset="aime24", reward="user_plugins:Nope")


def test_every_aime_problem_is_a_valid_observation():
    """Unicode in problems (AIME 2025 #26 has a bullet) is inside the observation space."""
    env = gym.make("areal_agents/Math-v0", dataset="aime25", reward_mode="inline").unwrapped
    assert len(env.data) == 30
    for i in range(len(env.data)):
        observation, _ = env.reset(options={"index": i})
        assert observation in env.observation_space, i


@pytest.mark.process
def test_math_env_inline_step_is_bounded_on_a_hostile_answer(finishes_within):
    """reward_mode="inline" verifies in the calling process: a tower of powers still ends the step in time,
    as a wrong answer that says why."""
    env = gym.make("areal_agents/Math-v0", dataset="aime24", reward_mode="inline").unwrapped
    env.reward_fn.config = MathVerifyConfig(timeout_s=0.5)
    env.reset(seed=0)
    _, reward, terminated, _, info = finishes_within(30.0, env.step, "\\boxed{10^{10^{10^{10^{10}}}}}")
    assert (reward, terminated, info["correct"], info["method"]) == (0.0, True, False, "timeout")
    assert "timeout_s=0.5" in info["reason"]


def test_math_env_in_process_loads_any_file_its_user_names(tmp_path):
    """The restriction is for an env server's clients: a user's own (local) config names any JSONL file."""
    path = tmp_path / "anywhere" / "mine.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"problem": "What is 6*7?", "answer": "42"}) + "\n")
    env = gym.make("areal_agents/Math-v0", dataset=str(path), reward_mode="inline")
    obs, _ = env.reset(seed=0)
    assert obs.startswith("What is 6*7?") and env.step("\\boxed{42}")[1] == 1.0


@pytest.mark.parametrize("template", ["{prompt:>300000000}", "{prompt}{prompt}", "{prompt.__class__}", "no field"])
def test_math_env_prompt_template_is_plain_and_bounded(template):
    with pytest.raises(ValueError, match="prompt_template"):
        gym.make("areal_agents/Math-v0", dataset="aime24", prompt_template=template)


def test_every_spelling_of_a_file_is_one_shared_dataset(tmp_path, monkeypatch):
    """The issue's 20 spellings of one path each kept a copy (RSS 0.5 -> 1.9 GB): now they are one."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "p", "answer": "1"}) + "\n")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    spellings = ["rows.jsonl", "./rows.jsonl", str(path), f"{tmp_path}/sub/../rows.jsonl", f"{tmp_path}//rows.jsonl"]
    first = load_task_dataset(spellings[0])
    assert all(load_task_dataset(s) is first for s in spellings)
    assert len({id(raw_rows(s)) for s in spellings}) == 1


def test_a_failed_load_is_not_kept(tmp_path):
    """A load that fails (here: no such prompt key) leaves nothing behind: the next load reads the file anew."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": "old", "answer": "1"}) + "\n")
    with pytest.raises(ArealAgentsError, match="no key 'prompt'"):
        load_task_dataset(str(path))
    path.write_text(json.dumps({"prompt": "new", "answer": "2"}) + "\n")
    assert load_task_dataset(str(path))[0]["prompt"] == "new"
