"""``launcher=ray`` on a local Ray cluster (2 CPUs): the arithmetic recipe with 2 env-server replicas,
2 rollout workers and a 2-rank gloo trainer, checked against the single-process trainer; and a run that
survives a killed env server and a killed rollout worker (real SIGKILLs) with a balanced ledger."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from areal_agents.config import TrainConfig, load_config
from areal_agents.models import load_model, load_tokenizer
from areal_agents.timeline import read_timeline
from areal_agents.trainers.policy import load_trainable
from areal_agents.trainers.policy_api import TrainSpec
from areal_agents.types import Trajectory

pytestmark = [
    pytest.mark.slow,
    pytest.mark.process,
    pytest.mark.skipif(find_spec("ray") is None, reason="ray is not installed"),
]

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "arithmetic" / "rl.yaml"
CLUSTER = [
    "launcher=ray", "ray.num_cpus=2", "ray.env_servers=2", "ray.rollout_workers=2", "ray.trainer_ranks=2",
    "ray.env_server_cpus=0.25", "ray.rollout_worker_cpus=0.25", "ray.trainer_cpus=0.25", "ray.engine_server_cpus=0.5",
]  # fmt: skip


def small(tiny_dir, run_dir, steps: int) -> list[str]:
    """The arithmetic recipe, small. The untrained tiny model scores 0 on every problem, so GRPO
    advantages would all be 0: with GAE and a reward bias the returns (1) differ from the zero-initialised
    values, every token gets an advantage, and the critic is a second model trained data-parallel."""
    return [
        f"model.path={tiny_dir}", f"run_dir={run_dir}", f"steps={steps}", "eval.num_problems=8",
        "rollout.batch_size=4", "rollout.group_size=4", "rollout.dump_trajectories=true",
        "ppo.advantage=gae", "ppo.reward_bias=1.0", "ppo.num_minibatches=2", "ppo.micro_batch_tokens=128",
        "save_every=1", "keep_checkpoints=0",
    ]  # fmt: skip


def train(args: list[str], cwd: Path = ROOT) -> subprocess.Popen:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "areal_agents.cli", "train", str(RECIPE), *args, "--no-progress"]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def control_without_the_key(run: Path) -> int:
    """The status a serve-model actor of ``run`` answers a /pause_generation without the run's admin key."""
    log = (run / "servers" / "serve-model-0.log").read_text()
    url = re.search(r"serve-model: .*?(http://\S+) ", log).group(1)
    request = urllib.request.Request(url + "/pause_generation", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


def balanced(ledger: dict) -> bool:
    ended = sum(ledger[k] for k in ledger if k not in ("submitted", "running"))
    return ledger["submitted"] == ended + ledger["running"] and ledger["running"] == 0


def test_ray_run_matches_the_single_process_trainer(tiny_dir, tmp_path):
    run = tmp_path / "ray"
    args = [*small(tiny_dir, run, 2), *CLUSTER]
    proc = train(args)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine_version"] == 2 and balanced(summary["episodes"])
    assert summary["episodes"]["accepted"] >= 2 * 16
    cluster = summary["cluster"]
    assert (cluster["env_servers"], cluster["rollout_workers"], cluster["trainer_ranks"]) == (2, 2, 2)
    assert all(n > 0 for n in cluster["episodes_per_worker"]), cluster  # both workers ran episodes
    assert all(n > 0 for n in cluster["env_steps_per_server"]), cluster  # both replicas served steps
    # every actor recorded into the run's timeline: both ranks' updates, both env servers' workers, both rollout
    # workers' generate calls and env steps, each named by its episode
    tl = read_timeline(run)
    assert tl.busy_share("trainer/policy/rank0") > 0 and tl.busy_share("trainer/policy/rank1") > 0
    assert len({p for p in tl.processes.values() if p.startswith("env-server-actor")}) == 2
    calls = [s for s in tl.spans if s.name in ("generate", "env_step") and s.process.startswith("rollout-worker")]
    assert len({s.process for s in calls}) == 2 and all("episode_id" in s.args for s in calls)

    # the single-process trainer on the data of step 1, from the same start, takes the same step
    cfg = load_config(TrainConfig, RECIPE, args)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(tiny_dir)
    policy = load_trainable("policy", TrainSpec.of(cfg, tokenizer.pad_token_id), str(tiny_dir), str(tiny_dir))
    rows = [json.loads(line) for line in (run / "trajectories" / "step_1.jsonl").read_text().splitlines()]
    batch = [Trajectory(**row) for row in rows]
    stats = policy.train_step(batch, torch.Generator().manual_seed(cfg.seed))
    assert stats["optimizer_steps"] == 2 and stats["trained_trajectories"] == len(batch)
    step1 = run / "checkpoints" / "step_1"
    ranks = load_model(step1 / "model").state_dict()
    start = load_model(tiny_dir).state_dict()
    assert any((ranks[k] - start[k]).abs().max() > 1e-4 for k in start)  # the step moved the weights
    for k, w in policy.model.state_dict().items():
        torch.testing.assert_close(ranks[k], w, rtol=0, atol=1e-5, msg=k)
    critic = torch.load(step1 / "trainer_state.pt", weights_only=False)["critic"]
    for k, w in policy.critic.state_dict().items():
        torch.testing.assert_close(critic[k], w, rtol=0, atol=1e-5, msg=f"critic {k}")

    # resume on 2 ranks: every rank loads the checkpoint's weights and optimizer, the data order goes on
    args = [a for a in args if not a.startswith("steps=")] + ["steps=3", "--resume"]
    proc = train(args)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    assert "resuming from" in out and json.loads((run / "summary.json").read_text())["engine_version"] == 3
    state = torch.load(run / "checkpoints" / "step_3" / "trainer_state.pt", weights_only=False)
    adam_steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert adam_steps == {6.0}  # 3 steps x 2 minibatches: the resumed ranks continued the optimizer
    order = [json.loads(line) for line in (run / "data_order.jsonl").read_text().splitlines()]
    assert [d["step"] for d in order] == [1, 2, 3]
    seen = [p for d in order for p in d["prompts"]]
    assert len(set(seen)) == len(seen) == 12  # no prompt trained twice across the restart

    # the checkpoint of a Ray run resumes in a local run (same layout, same trainer state)
    local = [a for a in args if not a.startswith(("launcher=", "ray.", "steps="))] + ["steps=4"]
    proc = train(local)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine_version"] == 4 and "cluster" not in summary
    state = torch.load(run / "checkpoints" / "step_4" / "trainer_state.pt", weights_only=False)
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {8.0}


def actor_pids(name: str) -> list[int]:
    """PIDs of this machine's Ray actor processes of class ``name`` (their title is ``ray::NAME``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if title.startswith(f"ray::{name}"):
                pids.append(int(entry.name))
    return pids


MARKING_AGENT = """
from areal_agents.agents.chat_agent import ChatAgent


class MarkingAgent(ChatAgent):
    async def run_episode(self, env, *, seed, episode_id):
        out = await super().run_episode(env, seed=seed, episode_id=episode_id)
        for t in out:
            t.metadata["ran"] = "MarkingAgent"
        return out
"""


def test_run_survives_a_killed_env_server_and_rollout_worker(tiny_dir, tmp_path):
    """Also: the user's own agent module, in the directory the command runs from, reaches the workers
    (and the restarted one)."""
    (tmp_path / "my_agent.py").write_text(MARKING_AGENT)
    run = tmp_path / "fault"
    args = [*small(tiny_dir, run, 4), *CLUSTER, "rollout.max_staleness=1", "rollout.max_retries=3"]
    proc = train([*args, "rollout.agent=my_agent:MarkingAgent"], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 600
        while not (run / "trajectories" / "step_1.jsonl").exists():  # rollouts of later steps are running
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        assert control_without_the_key(run) == 401  # the run's servers, on the node's address, want its key
        killed = {}
        for name in ("EnvServerActor", "RolloutWorker"):
            pids = actor_pids(name)
            assert len(pids) == 2, (name, pids)
            os.kill(pids[0], signal.SIGKILL)
            killed[name] = pids[0]
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine_version"] == 4 and balanced(summary["episodes"]), summary["episodes"]
    data = [json.loads(line) for line in (run / "data_order.jsonl").read_text().splitlines()]
    assert [len(d["prompts"]) for d in data] == [4, 4, 4, 4]  # every step trained on a full batch
    assert "did not come back" not in out
    lost = summary["cluster"]["episodes_lost_with_a_worker"]
    assert lost > 0 and summary["episode_retries"] >= lost  # in-flight episodes of the dead worker ran again
    assert actor_pids("EnvServerActor") == actor_pids("RolloutWorker") == []  # nothing left behind
    for step in range(1, 5):
        rows = (run / "trajectories" / f"step_{step}.jsonl").read_text().splitlines()
        assert rows and all(json.loads(row)["metadata"]["ran"] == "MarkingAgent" for row in rows)


def test_a_lora_policy_on_ray(tiny_dir, tmp_path):
    """``model.lora`` on Ray: the base model's servers start LoRA-enabled, the trainer actor trains the
    adapter alone and pushes it (the servers load it by name), the rollout workers name it on every request,
    and checkpoints hold PEFT's directory. (One adapter per agent: tests/cluster/test_ray_debate.py.)"""
    from safetensors.torch import load_file

    run = tmp_path / "lora"
    args = [
        f"model.path={tiny_dir}", f"run_dir={run}", "steps=2", "eval.num_problems=1", "rollout.batch_size=2",
        "rollout.group_size=4", "env.id=tests.trainers.test_lora:DigitShare", "env.module=tests.trainers.test_lora",
        "env.kwargs={}", "eval.env_kwargs={}", "ppo.filter_zero_variance_groups=false", "ppo.lr=1e-2", "model.lora.r=8",
        "launcher=ray", "ray.num_cpus=2", "ray.env_servers=1", "ray.rollout_workers=1", "ray.trainer_ranks=1",
        "ray.env_server_cpus=0.25", "ray.rollout_worker_cpus=0.25", "ray.trainer_cpus=0.25",
        "ray.engine_server_cpus=0.5",
    ]  # fmt: skip
    proc = train(args)  # from the repo root: the env servers import the test module's env
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine_version"] == 2 and balanced(summary["episodes"])
    assert summary["cluster"]["episodes_per_worker"][0] > 0  # the worker's requests named the adapter
    pushed = run / "engine_weights" / "lora" / "policy" / "v2" / "adapter_model.safetensors"
    assert pushed.is_file() and all("lora_" in k for k in load_file(pushed))
    ckpt = run / "checkpoints" / "step_2" / "model"
    assert json.loads((ckpt / "adapter_config.json").read_text())["r"] == 8
    adapter = load_file(ckpt / "adapter_model.safetensors")
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k), "the adapter did not train"


def test_rollout_workers_name_each_agent_s_adapter(tiny_dir):
    """A worker's agent generates through one view per LoRA policy, as the driver's does."""
    from areal_agents.cluster.rollout_workers import adapter_views
    from areal_agents.engines.base import InferenceEngine
    from areal_agents.engines.lora_sync import AdapterView

    engine = type("Servers", (InferenceEngine,), {})()  # no servers behind it: only the views are built
    shared = load_config(TrainConfig, None, [f"model.path={tiny_dir}", "model.lora.r=8"])
    assert (
        isinstance(adapter_views(shared, engine), AdapterView) and adapter_views(shared, engine).lora_name == "policy"
    )
    per_agent = load_config(TrainConfig, None, [f"model.path={tiny_dir}", "policies.a.lora.r=8", "policies.b.lora.r=8"])
    views = adapter_views(per_agent, engine)
    assert {name: v.lora_name for name, v in views.items()} == {"a": "a", "b": "b"}
    assert adapter_views(load_config(TrainConfig, None, [f"model.path={tiny_dir}"]), engine) is engine
