"""A prompt longer than the model's context generates nothing and ends by `length`; eval and the held-out
eval of `train` and `sft` say how many prompts did not fit, once, instead of leaving a truncation rate to
hint at it."""

import asyncio

import pytest

from areal_agents.cli import main
from areal_agents.models.loading import model_context, warn_prompts_over_context
from areal_agents.rollout.held_out import evaluate


@pytest.mark.process
def test_eval_names_the_prompts_longer_than_the_context(tmp_path, tiny_dir, capsys):
    # 8 of AIME 2024's 30 problems render past the tiny model's 512 positions
    assert model_context(tiny_dir) == 512
    args = ["eval", "--dataset", "aime24", "--model", str(tiny_dir), "--n-samples", "1", "--max-new-tokens", "1"]
    assert main([*args, "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "warning: eval: 8 of 30 prompts do not fit the model's context (512 positions)" in err


def test_the_warning_is_said_once_and_not_when_all_fit(capsys):
    warn_prompts_over_context(0, 5, 512, "test-a")
    assert capsys.readouterr().err == ""
    warn_prompts_over_context(2, 5, None, "test-b")
    warn_prompts_over_context(2, 5, None, "test-b")  # the next held-out eval of the same run
    assert capsys.readouterr().err.count("test-b: 2 of 5 prompts do not fit") == 1


class NoRoom:
    """An agent whose every prompt is past the context: as `ChatAgent`, it returns no trajectory."""

    async def run_episode(self, env, *, seed, episode_id):
        return []


class Env:
    async def areset(self, seed=None, options=None):
        return "q", {}

    async def aclose(self):
        pass


def test_the_held_out_eval_warns_too(capsys):
    result = asyncio.run(evaluate(NoRoom(), Env, [0, 1, 2]))
    assert result["accuracy"] == 0.0
    assert "warning: held-out eval: 3 of 3 prompts do not fit the model's context" in capsys.readouterr().err
