"""`areal-agents eval` on a user's own env: problems are seeds 0..N-1, success is the env's info["success"]
or a return at the threshold; and bundled presets, hub sources and the public-tests note."""

import asyncio
import json
import re
import sys
import textwrap

import gymnasium as gym
import pytest

from areal_agents.data.base import raw_rows
from areal_agents.engines.base import InferenceEngine
from areal_agents.errors import ArealAgentsError, ConfigError
from areal_agents.eval.presets import resolve
from areal_agents.eval.runner import eval_settings, evaluate_dataset
from areal_agents.types import GenResponse

# A user's env module: seed s asks for letter "abc"[s % 3]; the reward is 0.5 for a right letter, so only
# info["success"] (when reported) or a threshold of 0.5 counts it as solved.
USER_ENVS = textwrap.dedent(
    '''
    import gymnasium as gym
    from areal_agents.envs.base import TextEnv

    class Letter(TextEnv):
        """Say the letter the seed picks."""

        def __init__(self, report_success=False):
            super().__init__()
            self.report_success = report_success

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.letter = "abc"[(seed or 0) % 3]
            return f"Say {self.letter}", {}

        def step(self, action):
            right = action.strip().startswith(self.letter)
            info = {"success": right} if self.report_success else {}
            return "", 0.5 if right else 0.0, True, False, info

    gym.register(id="my/Letter-v0", entry_point=Letter)
    '''
)


@pytest.fixture
def user_envs(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(USER_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("my_envs", None)
    gym.registry.pop("my/Letter-v0", None)
    import my_envs  # noqa: F401  (registers my/Letter-v0)

    return tmp_path


class LetterEngine(InferenceEngine):
    """Answers the right letter for problem i, sample j when ``right(i, j)``, else "z"."""

    def __init__(self, tokenizer, right):
        self.tokenizer, self.right = tokenizer, right

    async def agenerate(self, request):
        i, j = map(int, re.match(r"p(\d+)/s(\d+)/", request.rid).groups())
        text = "abc"[i % 3] if self.right(i, j) else "z"
        tokens = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return GenResponse(tokens, [-0.1] * len(tokens), [0] * len(tokens), "stop")


def run_letter(tmp_path, tokenizer, right, *, env_kwargs=None, threshold=1.0, n=2, problems=6):
    settings = eval_settings(
        None,
        env_id="my/Letter-v0",
        env_kwargs=env_kwargs,
        n_samples=n,
        num_problems=problems,
        success_threshold=threshold,
        max_new_tokens=4,
    )
    engine = LetterEngine(tokenizer, right)
    return asyncio.run(evaluate_dataset(settings, engine, tokenizer, tmp_path / "out", progress=False))


def test_a_user_env_is_evaluated_over_seeds_with_its_success_info(user_envs, tokenizer):
    # problems 0-2 right on every sample, 3 right on sample 0 only, 4-5 never
    summary = run_letter(
        user_envs, tokenizer, lambda i, j: i < 3 or (i == 3 and j == 0), env_kwargs={"report_success": True}
    )
    assert summary["problems"] == 6 and summary["samples"] == 12
    assert summary["avg@2"] == pytest.approx((3 + 0.5) / 6)
    assert summary["pass@2"] == pytest.approx(4 / 6)
    assert "maj@1" not in summary  # the env reports no answer to vote on
    rows = [json.loads(line) for line in (user_envs / "out" / "samples.jsonl").read_text().splitlines()]
    assert {r["problem_id"] for r in rows} == {f"seed{s}" for s in range(6)}


def test_without_success_info_the_return_threshold_decides(user_envs, tokenizer):
    always = lambda i, j: True  # noqa: E731
    assert run_letter(user_envs, tokenizer, always, threshold=1.0)["avg@2"] == 0.0  # a right letter returns 0.5
    (user_envs / "out" / "samples.jsonl").unlink()
    assert run_letter(user_envs, tokenizer, always, threshold=0.5)["avg@2"] == 1.0


def test_an_env_without_dataset_needs_num_problems(user_envs, tokenizer):
    with pytest.raises(ConfigError, match="--num-problems"):
        run_letter(user_envs, tokenizer, lambda i, j: True, problems=None)


def test_cli_evaluates_a_user_env_with_the_tiny_model(user_envs, tiny_dir, capsys):
    from areal_agents.cli import main

    args = ["eval", "--env", "my/Letter-v0", "--module", "my_envs", "--model", str(tiny_dir), "--num-problems", "4"]
    assert main([*args, "--n-samples", "2", "--max-new-tokens", "4", "--no-progress"]) == 0
    summary = json.loads((user_envs / "runs" / "eval" / "my_Letter-v0" / "summary.json").read_text())
    assert summary["problems"] == 4 and summary["samples"] == 8 and summary["failed_samples"] == 0
    assert summary["run"]["model"] == str(tiny_dir) and summary["settings"]["env_id"] == "my/Letter-v0"
    assert "avg@2" in capsys.readouterr().out


def test_cli_eval_reads_a_train_configs_env_section(user_envs, tiny_dir):
    from areal_agents.cli import main

    config = user_envs / "eval.yaml"
    config.write_text(
        "env: {id: my/Letter-v0, module: my_envs, kwargs: {report_success: true}}\n"
        f"model: {tiny_dir}\nnum_problems: 3\nmax_new_tokens: 2\n"
    )
    assert main(["eval", "--config", str(config), "--out", "out", "--no-progress"]) == 0
    summary = json.loads((user_envs / "out" / "summary.json").read_text())
    assert summary["problems"] == 3 and summary["settings"]["env_kwargs"] == {"report_success": True}
    config.write_text("env: {id: my/Letter-v0, kwarg: {}}\n")
    assert main(["eval", "--config", str(config), "--model", str(tiny_dir)]) == 2


def test_cli_eval_errors_name_what_is_missing(tiny_dir, capsys):
    from areal_agents.cli import main

    assert main(["eval", "--model", str(tiny_dir)]) == 2
    assert "--dataset or --env" in capsys.readouterr().err
    assert main(["eval", "--dataset", "aime_24", "--model", str(tiny_dir), "--no-progress"]) == 2
    assert "Did you mean 'aime24'" in capsys.readouterr().err
    assert main(["eval", "--env", "my/Letter-v0", "--model", str(tiny_dir), "--env-kwargs", "[1]"]) == 2
    assert "--env-kwargs" in capsys.readouterr().err


def test_presets_read_bundled_copies_and_hub_copies_on_request():
    assert resolve("aime24")[:2] == ("aime24", None)
    assert resolve("gsm8k")[:2] == ("gsm8k", "test")
    assert resolve("lcb")[:2] == ("lcb_v5", None) and resolve("lcb")[2].env_kwargs["max_runs"] == 0
    assert resolve("aime24", hub=True)[:2] == ("hf:HuggingFaceH4/aime_2024", "train")
    assert resolve("lcb", hub=True)[0] == "hf:livecodebench/code_generation_lite?version_tag=release_v5"
    assert resolve("lcb_hidden3")[2].env_id == "areal_agents/Code-v0"
    assert resolve("mbpp_test20")[2].env_kwargs == {"max_turns": 1, "max_runs": 0}
    assert resolve("runs/x/aime25.jsonl")[2].n_samples == 32  # a file named like a preset takes its settings
    with pytest.raises(ConfigError, match="no hub copy"):
        resolve("gsm8k", hub=True)
    with pytest.raises(ConfigError, match="Did you mean 'math500'"):
        resolve("x.jsonl", preset="math50")


def test_hub_sources_pass_their_split_and_parameters_mocked_hub(monkeypatch):
    """No network here: a stand-in `datasets` module records what the hub loader asks for."""
    import types

    calls = []
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda path, split, **kw: calls.append((path, split, kw)) or [{"problem": "p", "answer": "1"}]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    raw_rows.cache_clear()
    source = "hf:livecodebench/code_generation_lite?version_tag=release_v5"
    assert raw_rows(source, "test") == ({"problem": "p", "answer": "1"},)
    assert raw_rows("HuggingFaceH4/aime_2024", "train")  # a plain ORG/NAME id is a hub id too
    assert raw_rows("hf:org/scripted?trust_remote_code=true&name=main", None)
    assert calls == [
        ("livecodebench/code_generation_lite", "test", {"version_tag": "release_v5"}),
        ("HuggingFaceH4/aime_2024", "train", {}),
        ("org/scripted", "test", {"trust_remote_code": True, "name": "main"}),
    ]
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(ArealAgentsError, match=r"areal-agents\[hf\]"):
        raw_rows("hf:org/other", "test")
    raw_rows.cache_clear()


def test_public_only_livecodebench_summaries_say_so(tmp_path, tokenizer):
    settings = eval_settings("lcb_v5_subset", n_samples=1, num_problems=2, max_new_tokens=4)
    engine = LetterEngine(tokenizer, lambda i, j: False)
    summary = asyncio.run(evaluate_dataset(settings, engine, tokenizer, tmp_path / "lcb", progress=False))
    assert summary["problems"] == 2 and "not comparable" in summary["notes"][0]
    settings = eval_settings("lcb_hidden3", n_samples=1, num_problems=1, max_new_tokens=4)
    summary = asyncio.run(evaluate_dataset(settings, engine, tokenizer, tmp_path / "hidden", progress=False))
    assert "notes" not in summary  # its rows carry their hidden tests
