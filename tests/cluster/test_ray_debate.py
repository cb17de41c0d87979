"""The debate recipe (examples/debate) on ``launcher=ray``: Debate-v0 behind the env-server actors, spoken over
the env-step protocol's v2, one shared policy and one LoRA adapter per debater, each trained 2 steps.

The task env under the debate is `AnyDigit` (below): the untrained tiny model answers 2-digit additions
wrongly every time, so every reward would be 0 and GRPO would train nothing; here a reply with a digit in it
is right, which a random model's groups sometimes are and sometimes not."""

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
from safetensors.torch import load_file

from areal_agents.envs.base import TextEnv

pytestmark = [
    pytest.mark.slow,
    pytest.mark.process,
    pytest.mark.skipif(find_spec("ray") is None, reason="ray is not installed"),
]

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "debate" / "rl.yaml"
RAY = [
    "launcher=ray", "ray.num_cpus=2", "ray.env_servers=1", "ray.rollout_workers=1", "ray.trainer_ranks=1",
    "ray.env_server_cpus=0.25", "ray.rollout_worker_cpus=0.25", "ray.trainer_cpus=0.25",
    "ray.engine_server_cpus=0.5",
]  # fmt: skip


class AnyDigit(TextEnv):
    """A question per seed; a reply with a digit in it is right (reward 1)."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return f"{seed}+1=", {}

    def step(self, action):
        right = any(c.isdigit() for c in action)
        return "", float(right), True, False, {"correct": right}


def debate(tiny_dir, run: Path, *extra: str) -> list[str]:
    task = "tests.cluster.test_ray_debate:AnyDigit"
    return [
        f"model.path={tiny_dir}", f"run_dir={run}", "steps=2", "eval.num_problems=2",
        "rollout.batch_size=2", "rollout.group_size=4", "rollout.dump_trajectories=true",
        f"env.kwargs.task_env={task}", "env.kwargs.task_kwargs={}", "eval.env_kwargs={task_kwargs: {}}",
        "env.module=tests.cluster.test_ray_debate", "ppo.filter_zero_variance_groups=false", "ppo.lr=1e-2",
        "save_every=2", *RAY, *extra,
    ]  # fmt: skip


def train(args: list[str]) -> str:
    """Run ``train`` from the repo root (the env servers import this module's env); its output."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "areal_agents.cli", "train", str(RECIPE), *args, "--no-progress"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def trained_agents(run: Path) -> set[str]:
    rows = [json.loads(line) for step in (1, 2) for line in (run / "trajectories" / f"step_{step}.jsonl").open()]
    assert all(len(row["input_ids"]) > 0 for row in rows)
    return {row["agent_id"] for row in rows}


def test_debate_with_a_shared_policy_on_ray(tiny_dir, tmp_path):
    run = tmp_path / "shared_policy"
    train(debate(tiny_dir, run))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine_version"] == 2 and summary["cluster"]["episodes_per_worker"][0] > 0
    assert trained_agents(run) == {"debater_0", "debater_1"}  # both debaters' turns, from the env server
    assert summary["episodes"]["env_failed"] == 0 and summary["episodes"]["accepted"] >= 2 * 2 * 4


def test_debate_with_an_adapter_per_debater_on_ray(tiny_dir, tmp_path):
    run = tmp_path / "lora"
    train(debate(tiny_dir, run, "policies.debater_0.lora.r=8", "policies.debater_1.lora.r=8"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine_version"] == 2 and summary["episodes"]["env_failed"] == 0
    for agent in ("debater_0", "debater_1"):  # each adapter was pushed to the servers and trained
        pushed = run / "engine_weights" / "lora" / agent / "v2" / "adapter_model.safetensors"
        assert pushed.is_file() and all("lora_" in k for k in load_file(pushed)), agent
        adapter = load_file(run / "checkpoints" / "step_2" / "policies" / agent / "model" / "adapter_model.safetensors")
        assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k), f"{agent}'s adapter did not train"
