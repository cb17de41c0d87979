"""tinker-cookbook's recipes, unchanged (``python -m tinker_cookbook.recipes...`` with CLI arguments only), against
a real ``serve-tinker`` process on a tiny Qwen3 (issue 49): the supervised recipe on the cookbook's own bundled
conversations with its loss going down, then the RL recipe (math_rl's arithmetic env) from that checkpoint, and the
RL recipe's default loss refused at once by name. Reward going up needs a warm-started base: examples/tinker/."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tinker_cookbook  # pyproject's dev extra (scripts/setup.sh)

from areal_agents.models.tiny import save_tiny_model
from tests.tinker.tinker_process import CLIENT_ENV, serve_tinker

pytestmark = [pytest.mark.process, pytest.mark.slow]
CONVERSATIONS = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server URL, base model dir): the model's name is its directory, as the cookbook loads tokenizers by it."""
    root = tmp_path_factory.mktemp("cookbook")
    base = save_tiny_model(root / "base", family="qwen3")
    with serve_tinker(root, {str(base): base}) as url:
        yield url, base


def run_recipe(served, module: str, log_path: Path, *args: str) -> subprocess.CompletedProcess:
    url, base = served
    argv = [sys.executable, "-m", f"tinker_cookbook.recipes.{module}", f"model_name={base}", f"base_url={url}"]
    argv += ["renderer_name=qwen3", f"log_path={log_path}", "behavior_if_log_dir_exists=delete", *args]
    env = {**os.environ, **CLIENT_ENV, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def final_state(log_path: Path) -> str:
    rows = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    return rows[-1]["state_path"]


@pytest.fixture(scope="module")
def sl_run(served, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("chat_sl")
    done = run_recipe(
        served, "chat_sl.train", log_path, f"dataset={CONVERSATIONS}", "batch_size=16", "max_steps=6",
        "learning_rate=2e-3", "lora_rank=8", "eval_every=0", "save_every=0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return log_path


def test_the_supervised_recipe_lowers_its_loss_on_the_cookbooks_conversations(sl_run):
    nll = [row["train_mean_nll"] for row in metrics(sl_run) if "train_mean_nll" in row]
    assert len(nll) == 6 and all(b < a for a, b in zip(nll, nll[1:])) and nll[-1] < nll[0] - 0.3, nll
    assert final_state(sl_run).endswith("/weights/final")


def test_the_rl_recipe_trains_from_the_supervised_checkpoint(served, sl_run, tmp_path):
    done = run_recipe(
        served, "math_rl.train", tmp_path / "rl", "env=arithmetic", "loss_fn=importance_sampling", "group_size=4",
        "groups_per_batch=4", "max_tokens=8", "max_steps=2", "learning_rate=1e-3", "eval_every=0", "save_every=0",
        f"load_checkpoint_path={final_state(sl_run)}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Loaded weights from tinker://" in done.stdout + done.stderr
    steps = [row for row in metrics(tmp_path / "rl") if "env/all/reward/total" in row]
    assert [row["progress/batch"] for row in steps] == [0, 1]
    assert all(row["env/all/total_episodes"] == 16 for row in steps)
    assert final_state(tmp_path / "rl").endswith("/weights/final")


def test_the_rl_recipes_default_loss_is_refused_by_name_at_once(served, tmp_path):
    """stable_reinforce needs stability data the sampler records on Tinker, in a form Tinker has not published."""
    done = run_recipe(
        served, "math_rl.train", tmp_path / "rl", "env=arithmetic", "group_size=2", "groups_per_batch=2",
        "max_tokens=4", "max_steps=1", "eval_every=0", "save_every=0",
    )  # fmt: skip
    assert done.returncode != 0
    assert "stable_reinforce" in done.stderr and "importance_sampling" in done.stderr, done.stderr[-3000:]
