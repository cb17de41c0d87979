"""The CLI as a user runs it: a 2-step SFT and RL smoke run, and one-line errors with exit code 2."""

import collections
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from areal_agents.cli import main


def write_configs(tmp_path, tiny_dir):
    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"{a}+1="},
                        {"role": "assistant", "content": str(a + 1)},
                    ]
                }
            )
            + "\n"
            for a in range(20)
        )
    )
    common = f"""
model: {{path: {tiny_dir}}}
env: {{id: areal_agents/Arithmetic-v0, kwargs: {{digits: 1, max_turns: 2}}}}
eval: {{num_problems: 8, env_kwargs: {{split: test}}}}
"""
    sft = tmp_path / "sft.yaml"
    sft.write_text(f"run_dir: {tmp_path / 'sft'}\ndata: {data}\nsteps: 2\nbatch_size: 8\nmax_new_tokens: 4\n{common}")
    rl = tmp_path / "rl.yaml"
    rl.write_text(
        f"run_dir: {tmp_path / 'rl'}\nsteps: 2\n"
        "rollout: {batch_size: 4, group_size: 4, max_new_tokens: 4}\n"
        f"ppo: {{filter_zero_variance_groups: false}}\n{common}"
    )
    return sft, rl


def test_sft_then_two_rl_steps_write_artefacts(tmp_path, tiny_dir, capsys):
    sft, rl = write_configs(tmp_path, tiny_dir)
    assert main(["sft", str(sft), "--no-progress"]) == 0
    model_dir = tmp_path / "sft" / "model"
    assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()

    assert main(["train", str(rl), f"model.path={model_dir}", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "held-out greedy accuracy before RL" in out and "after RL" in out
    run = tmp_path / "rl"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine_version"] == 2  # one weight push per step
    assert (
        summary["episodes"]["submitted"] == summary["episodes"]["accepted"] == 32
        and summary["episodes"]["running"] == 0
    )
    ckpt = run / "checkpoints" / "step_2"
    assert (ckpt / "model" / "model.safetensors").is_file() and (ckpt / "trainer_state.pt").is_file()
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(run / "tensorboard")).Reload().Tags()["scalars"]
    for key in (
        "rollout/reward_mean",
        "train/loss",
        "train/clip_fraction",
        "train/behav_weight_mean",
        "perf/gen_tokens_per_s",
        "eval/accuracy",
        "engine/version",
        "engine/prefix_hit_rate",
    ):
        assert key in tags
    assert main(["plot", str(run)]) == 0
    assert sorted(p.name for p in (run / "plots").glob("*.png")) == [
        "accuracy.png",
        "reward.png",
        "staleness.png",
        "throughput.png",
    ]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "areal_agents.cli", *args], capture_output=True, text=True)


@pytest.mark.process
@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "missing.yaml"], "config file not found: missing.yaml"),
        (["train", "{rl}", "env.id=areal_agents/Arithmetc-v0"], "unknown env id 'areal_agents/Arithmetc-v0'"),
        (["train", "{rl}", "model.path=/nonexistent/model"], "model path does not exist: /nonexistent/model"),
        (["train", "{rl}", "ppo.lrr=1"], "unknown config key 'ppo.lrr'"),
        (["sft", "{sft}", "data=/nonexistent.jsonl"], "data file not found: /nonexistent.jsonl"),
    ],
)
def test_user_errors_are_one_line_exit_2(tmp_path, tiny_dir, args, message):
    sft, rl = write_configs(tmp_path, tiny_dir)
    result = run_cli(*[a.format(rl=rl, sft=sft) for a in args])
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_tiny_model_command(tmp_path):
    assert main(["tiny-model", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert main(["tiny-model", str(tmp_path / "long"), "--context", "32768"]) == 0
    assert json.loads((tmp_path / "long" / "config.json").read_text())["max_position_embeddings"] == 32768


@pytest.mark.process
def test_rl_through_the_env_server(tmp_path, tiny_dir):
    """env.backend=server launches a local env-step server for the run and stops it at the end."""
    _, rl = write_configs(tmp_path, tiny_dir)
    assert main(["train", str(rl), "env.backend=server", "env.workers=2", "--no-progress"]) == 0
    summary = json.loads((tmp_path / "rl" / "summary.json").read_text())
    assert summary["engine_version"] == 2 and summary["episodes"]["accepted"] == 32


USER_ENV = '''
import gymnasium as gym
from areal_agents.envs import TextEnv


class Parrot(TextEnv):
    """Repeat the word; reward 1 for an exact repeat."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.word = str(self.np_random.choice(["cat", "dog", "sun"]))
        return self.word, {}

    def step(self, action):
        return "", float(action.strip() == self.word), True, False, {}


gym.register(id="user_envs/Parrot-v0", entry_point=Parrot)
'''


@pytest.mark.parametrize("how", ["module", "class"])
def test_user_env_from_its_own_module_trains(tmp_path, tiny_dir, monkeypatch, how):
    (tmp_path / "my_user_envs.py").write_text(USER_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    _, rl = write_configs(tmp_path, tiny_dir)
    env_args = (
        ["env.module=my_user_envs", "env.id=user_envs/Parrot-v0"] if how == "module" else ["env.id=my_user_envs:Parrot"]
    )
    args = ["train", str(rl), *env_args, "env.kwargs={}", "eval.env_kwargs={}", "eval.num_problems=3", "--no-progress"]
    assert main(args) == 0
    assert json.loads((tmp_path / "rl" / "summary.json").read_text())["engine_version"] == 2


@pytest.mark.parametrize(
    "recipe, dataset",
    [
        pytest.param("math", None, marks=pytest.mark.process),
        ("code", None),
        ("code", "lcb_v5_subset"),
    ],  # math-verify's pool
)
def test_math_and_code_recipes_run_on_the_tiny_model(tmp_path, tiny_dir, recipe, dataset):
    """The recipes as shipped (bundled GSM8K and MBPP train), and the code recipe on LiveCodeBench rows."""
    if recipe == "code" and __import__("shutil").which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    path = Path(__file__).resolve().parents[1] / "examples" / recipe / "rl.yaml"
    args = [
        "train", str(path), f"run_dir={tmp_path / recipe}", f"model.path={tiny_dir}", "steps=2",
        "rollout.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "eval.num_problems=4",
        "--no-progress", *([f"env.kwargs.dataset={dataset}"] if dataset else []),
    ]  # fmt: skip
    assert main(args) == 0
    assert json.loads((tmp_path / recipe / "summary.json").read_text())["engine_version"] == 2


@pytest.mark.process
def test_rl_through_serve_model_and_the_sglang_client(tmp_path, tiny_dir, capsys):
    """The remote path: the run launches serve-model, generates over HTTP and pushes weights from disk."""
    _, rl = write_configs(tmp_path, tiny_dir)
    assert main(["train", str(rl), "engine.backend=serve-model", "--no-progress"]) == 0
    summary = json.loads((tmp_path / "rl" / "summary.json").read_text())
    assert summary["engine_version"] == 2
    assert (
        summary["episodes"]["submitted"] == summary["episodes"]["accepted"] == 32
        and summary["episodes"]["running"] == 0
    )
    assert (tmp_path / "rl" / "servers" / "serve-model-0.log").is_file()
    weights = sorted(p.name for p in (tmp_path / "rl" / "engine_weights").iterdir())
    assert weights == ["v1", "v2"]  # older pushes are pruned


@pytest.mark.slow  # 30-60 s each on 2 cores: kept out of the default run
@pytest.mark.process
@pytest.mark.parametrize("trainer", ["ppo.trainer=process", "ppo.nproc_per_node=2"], ids=["process", "ranks"])
def test_rl_broadcasting_weights_from_the_trainer_processes_to_serve_model(tmp_path, tiny_dir, trainer):
    """engine.weight_sync=broadcast with the trainer in processes of its own: its rank 0 hosts the weight group
    and sends the buckets (over gloo here, NCCL from a GPU); no weights are written to disk for the servers."""
    _, rl = write_configs(tmp_path, tiny_dir)
    args = ["train", str(rl), "engine.backend=serve-model", "engine.weight_sync=broadcast", trainer]
    assert main([*args, "--no-progress"]) == 0
    summary = json.loads((tmp_path / "rl" / "summary.json").read_text())
    assert summary["engine_version"] == 2 and summary["episodes"]["running"] == 0
    assert not (tmp_path / "rl" / "engine_weights").exists()


@pytest.mark.slow  # 30-60 s each on 2 cores: kept out of the default run
@pytest.mark.process
def test_resume_after_kill_9_continues_with_the_same_data_order(tmp_path, tiny_dir):
    """A run killed (SIGKILL) mid-step and resumed sees the same prompts per step as one that never stopped."""
    _, rl = write_configs(tmp_path, tiny_dir)
    args = [str(rl), "steps=6", "save_every=1", "keep_checkpoints=2", "--no-progress"]
    reference = run_cli("train", *args, f"run_dir={tmp_path / 'ref'}")
    assert reference.returncode == 0, reference.stderr

    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "areal_agents.cli", "train", *args, f"run_dir={run}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step_3").is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run / "summary.json").exists(), "killed before the end"
    resumed = run_cli("train", *args, f"run_dir={run}", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout

    def order(path):
        steps = {}
        for line in (path / "data_order.jsonl").read_text().splitlines():
            row = json.loads(line)
            steps[row["step"]] = row["prompts"]  # a step cut off by the kill is logged again on resume
        return steps

    assert order(run) == order(tmp_path / "ref")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine_version"] == 6 and summary["episodes"]["running"] == 0
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == ["step_5", "step_6"]  # keep_checkpoints=2


def test_gae_with_a_critic_trains_checkpoints_and_resumes(tmp_path, tiny_dir):
    """advantage=gae with activation checkpointing and a cosine schedule; the critic rides in the checkpoint."""
    _, rl = write_configs(tmp_path, tiny_dir)
    args = ["train", str(rl), "ppo.advantage=gae", "ppo.activation_checkpointing=true", "ppo.lr_schedule=cosine"]
    assert main([*args, "--no-progress"]) == 0
    run = tmp_path / "rl"
    state = torch.load(run / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=False)
    assert "head.weight" in state["critic"] and state["critic_optimizer"]["state"]
    assert state["scheduler"]["last_epoch"] == 2

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = EventAccumulator(str(run / "tensorboard"), size_guidance={"histograms": 0}).Reload()
    tags = logs.Tags()
    for key in ("train/value_loss", "train/return_mean", "rollout/reward_turn/1", "perf/train_tokens_per_s"):
        assert key in tags["scalars"], key
    assert "rollout/reward_env/areal_agents/Arithmetic-v0" in tags["scalars"]
    assert "rollout/staleness" in tags["histograms"]

    assert main([*args, "steps=3", "--resume", "--no-progress"]) == 0
    assert json.loads((run / "summary.json").read_text())["engine_version"] == 3


@pytest.mark.slow  # 30-60 s each on 2 cores: kept out of the default run
@pytest.mark.process
def test_async_run_with_engine_and_trainer_in_their_own_processes_trains_and_resumes(tmp_path, tiny_dir):
    """The small-machine async layout: rollouts in this process, the engine and the trainer in two others."""
    _, rl = write_configs(tmp_path, tiny_dir)
    args = ["train", str(rl), "rollout.max_staleness=1", "engine.own_process=true", "ppo.trainer=process"]
    assert main([*args, "--no-progress"]) == 0
    run = tmp_path / "rl"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine_version"] == 2 and summary["episodes"]["running"] == 0
    assert 0 < summary["train_seconds"] < summary["step_seconds"]  # where the steps' time went
    assert 0 < summary["engine_busy_fraction"] <= 1.05  # of the engine process, over the training steps
    state = torch.load(run / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=False)
    assert state["scheduler"]["last_epoch"] == 2 and state["optimizer"]["state"]  # fetched from the trainer process
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(run / "tensorboard")).Reload().Tags()["scalars"]
    for key in ("engine/prefix_hit_rate", "engine/busy_fraction", "engine/rows_per_decode_step"):
        assert key in scalars, key
    assert "perf/rollout_wait_seconds" in scalars  # streamed updates (max_staleness 1): the trainer's idle time
    assert main([*args, "steps=3", "--resume", "--no-progress"]) == 0
    assert json.loads((run / "summary.json").read_text())["engine_version"] == 3


@pytest.mark.parametrize("stream", [True, False])
def test_async_run_in_one_process_streams_its_updates_or_not(tmp_path, tiny_dir, stream, monkeypatch):
    """max_staleness 1 with the trainer thread: the update fed group by group (`Policy.update_part` and
    `finish_update`, never `update`) with ppo.stream_updates, else whole (never `update_part`)."""
    from areal_agents.trainers.policy import Policy

    calls = []
    for name in ("update", "update_part", "finish_update"):
        original = getattr(Policy, name)

        async def counted(self, *args, _original=original, _name=name):
            calls.append(_name)
            return await _original(self, *args)

        monkeypatch.setattr(Policy, name, counted)
    _, rl = write_configs(tmp_path, tiny_dir)
    args = ["train", str(rl), "rollout.max_staleness=1", f"ppo.stream_updates={str(stream).lower()}"]
    assert main([*args, "--no-progress"]) == 0
    summary = json.loads((tmp_path / "rl" / "summary.json").read_text())
    assert summary["engine_version"] == 2 and summary["episodes"]["running"] == 0
    if stream:
        assert "update" not in calls and calls.count("finish_update") == 2 and "update_part" in calls
    else:
        assert calls == ["update", "update"]


@pytest.mark.process
def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, tiny_dir):
    _, rl = write_configs(tmp_path, tiny_dir)
    out = run_cli("train", str(rl), f"run_dir={tmp_path / 'fresh'}", "--resume")
    assert out.returncode == 2 and "--resume: no complete checkpoint under" in out.stderr


DEBATE = Path(__file__).resolve().parents[1] / "examples" / "debate"
EVEN_TASK = """
from areal_agents.envs import TextEnv


class EvenSum(TextEnv):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return f"Say something whose characters sum to an even number ({int(self.np_random.integers(1000))}).", {}

    def step(self, action):
        return "", float(sum(map(ord, action)) % 2 == 0), True, False, {}
"""


@pytest.mark.parametrize(
    "recipe, staleness, lora",
    [
        ("rl.yaml", 0, False),
        ("rl_separate.yaml", 0, False),
        ("rl_separate.yaml", 1, False),
        ("rl_separate.yaml", 1, True),
    ],
)
def test_debate_recipes_train_per_agent(tmp_path, tiny_dir, recipe, staleness, lora, monkeypatch):
    """2 RL steps of each debate recipe: per-agent rewards logged; separate policies each change, each
    trained on exactly its own agent's trajectories (at max_staleness 1, each policy's update streamed).
    The task rewards answers whose character codes sum to an even number: a coin flip per answer for an
    untrained model (not the length, which max_new_tokens caps, so often the same), and with 4 groups of
    4 per debater the chance that no group of a debater differs in reward, leaving its policy without a
    gradient, is 2^-12. With ``lora`` each debater trains an adapter of its own on one base model in memory
    (one trained copy, one engine)."""
    (tmp_path / "even_task.py").write_text(EVEN_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "debate"
    small = ["steps=2", "eval.num_problems=4", "rollout.batch_size=2", "rollout.group_size=4"]
    small += ["env.kwargs.task_env=even_task:EvenSum", "env.kwargs.task_kwargs={}", "eval.env_kwargs={}"]
    small += ["ppo.filter_zero_variance_groups=false", f"model.path={tiny_dir}", f"run_dir={run}"]
    small += ["rollout.dump_trajectories=true"]
    if recipe == "rl_separate.yaml" and not lora:
        small += [f"policies.debater_0={tiny_dir}", f"policies.debater_1={tiny_dir}"]
    bases = []
    if lora:
        small += ["policies.debater_0.lora.r=8", "policies.debater_1.lora.r=8", "ppo.lr=1e-3"]
        from areal_agents.trainers.lora import LoraBase

        opened = LoraBase.__init__

        def spy(self, *args, **kwargs):
            opened(self, *args, **kwargs)
            bases.append(self)

        monkeypatch.setattr(LoraBase, "__init__", spy)
    small += [f"rollout.max_staleness={staleness}"]
    assert main(["train", str(DEBATE / recipe), *small, "--no-progress"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine_version"] == 2
    assert summary["episodes"]["accepted"] == 16 if staleness == 0 else summary["episodes"]["accepted"] >= 16

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(run / "tensorboard")).Reload()
    tags = scalars.Tags()["scalars"]
    for agent in ("debater_0", "debater_1"):
        assert f"rollout/reward_agent/{agent}" in tags and f"rollout/reward_turn/{agent}/2" in tags
        assert f"eval/accuracy/{agent}" in tags
    from areal_agents.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_dir)
    for step in (1, 2):
        rows = [json.loads(line) for line in (run / "trajectories" / f"step_{step}.jsonl").read_text().splitlines()]
        episodes = {(row["episode_id"], row["agent_id"]): row["metadata"]["num_segments"] for row in rows}
        assert sorted(a for _, a in episodes) == ["debater_0"] * 8 + ["debater_1"] * 8
        assert len(rows) == sum(episodes.values())  # a segment where a re-render would not give the sampled tokens
        runs_of = collections.Counter()
        for row in rows:  # the loss mask is exactly this debater's own replies, one run per round
            runs = "".join("1" if m else " " for m in row["loss_mask"]).split()
            replies = [m["content"] for m in row["metadata"]["messages"] if m["role"] == "assistant"]
            runs_of[row["episode_id"], row["agent_id"]] += len(runs)
            masked = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m and t != tokenizer.eos_token_id]
            assert tokenizer.decode(masked, skip_special_tokens=False) == "".join(replies[-len(runs) :])
            other = "debater_1" if row["agent_id"] == "debater_0" else "debater_0"
            unmasked = tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if not m])
            assert f"{row['agent_id']}: " not in unmasked
            if len(runs) == 2 or row["metadata"]["segment"] > 0:  # it holds a round after the other's answer
                assert f"{other}: " in unmasked
        assert set(runs_of.values()) == {2}  # two rounds of each debater in each episode, each trained once
        if step == 1:
            trained_first = len(rows)
    if recipe == "rl.yaml":
        assert scalars.Scalars("train/trained_trajectories")[0].value == trained_first  # both debaters', one model
        return
    from areal_agents.models import load_model

    if lora:
        _assert_each_adapter_trained_on_one_base(run, bases, scalars)
        return
    start = load_model(tiny_dir).state_dict()
    for agent in ("debater_0", "debater_1"):
        # each policy trained on its own debater's 8 trajectories (2 prompts x 4 episodes) per step
        assert [e.value for e in scalars.Scalars(f"train/{agent}/trained_trajectories")] == [8.0, 8.0]
        trained = load_model(run / "checkpoints" / "step_2" / "policies" / agent / "model").state_dict()
        assert any(not torch.equal(trained[k], start[k]) for k in start), f"{agent}'s weights did not change"
    a = load_model(run / "checkpoints" / "step_2" / "policies" / "debater_0" / "model").state_dict()
    b = load_model(run / "checkpoints" / "step_2" / "policies" / "debater_1" / "model").state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)  # different data, different models


def _assert_each_adapter_trained_on_one_base(run, bases, scalars):
    from safetensors.torch import load_file

    assert len(bases) == 1 and sorted(bases[0].peft.peft_config) == ["debater_0", "debater_1"]
    adapters = {}
    for agent in ("debater_0", "debater_1"):
        dumps = [run / "trajectories" / f"step_{step}.jsonl" for step in (1, 2)]
        own = [sum(json.loads(line)["agent_id"] == agent for line in d.read_text().splitlines()) for d in dumps]
        assert [e.value for e in scalars.Scalars(f"train/{agent}/trained_trajectories")] == own  # its own alone
        adapters[agent] = load_file(
            run / "checkpoints" / "step_2" / "policies" / agent / "model" / "adapter_model.safetensors"
        )
        b = [v for k, v in adapters[agent].items() if "lora_B" in k]
        assert b and any(v.abs().max() > 0 for v in b), f"{agent}'s adapter did not change (B starts at zero)"
    a, b = adapters["debater_0"], adapters["debater_1"]
    assert any(not torch.equal(a[k], b[k]) for k in a if "lora_B" in k)  # different data, different adapters


def test_train_evaluates_with_sampling_when_asked(tmp_path, tiny_dir):
    _, rl = write_configs(tmp_path, tiny_dir)
    args = ["train", str(rl), "steps=1", "eval.n_samples=3", "eval.temperature=1.0", "eval.top_p=0.9"]
    assert main([*args, "--no-progress"]) == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(tmp_path / "rl" / "tensorboard")).Reload()
    assert "eval/pass@3" in scalars.Tags()["scalars"]
    assert scalars.Scalars("eval/episodes")[0].value == 8 * 3  # 8 problems x 3 samples


def test_max_train_minutes_stops_early_and_finishes_like_the_last_step(tmp_path, tiny_dir, capsys):
    _, rl = write_configs(tmp_path, tiny_dir)
    assert main(["train", str(rl), "steps=50", "max_train_minutes=0.0001", "--no-progress"]) == 0
    summary = json.loads((tmp_path / "rl" / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["engine_version"] == 1  # one step spent the budget
    assert summary["checkpoint"].endswith("step_1") and Path(summary["checkpoint"], "model").is_dir()
    assert "stopped after step 1: max_train_minutes=0.0001" in capsys.readouterr().out
    assert main(["train", str(rl), "steps=50", "max_train_minutes=-1", "--no-progress"]) == 2


ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p.relative_to(ROOT).as_posix()
    for pattern in ("scripts/*.sh", "examples/*/*.sh", "examples/*/*.py")
    for p in ROOT.glob(pattern)
)


@pytest.mark.process
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help_with_its_usage_and_runs_nothing(script, tmp_path):
    """`bash examples/arithmetic/run.sh --help` once built the tiny model and its SFT data; now every script
    prints its usage and exits 0 (a .sh in well under a second: it stops before its first command)."""
    runner = ["bash"] if script.endswith(".sh") else [sys.executable]
    started = time.monotonic()
    done = subprocess.run(
        [*runner, str(ROOT / script), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.lower().startswith("usage:"), done.stdout[:200]
    assert not script.endswith(".sh") or time.monotonic() - started < 5
