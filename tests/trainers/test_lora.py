"""LoRA policies: only the adapter trains (and has optimizer state), the KL reference is the base with the
adapter off, the critic trains its own adapter and head, checkpoints are PEFT's directory, `export-lora`
merges them, and a run trains, resumes and pushes adapter-only weights to its engine."""

import asyncio
import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from areal_agents.cli import main
from areal_agents.config import LoraConfig, TrainConfig, load_config
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.lora_sync import LoraGroup
from areal_agents.envs import TextEnv
from areal_agents.errors import ConfigError
from areal_agents.models import load_model
from areal_agents.trainers.batching import make_micro_batches, token_logprobs
from areal_agents.trainers.lora import trainable_bytes
from areal_agents.trainers.policy import load_trainable
from areal_agents.trainers.policy_api import TrainSpec
from areal_agents.types import GenRequest, SamplingParams, Trajectory
from tests.trainers.rl_configs import write_rl_config


class DigitShare(TextEnv):
    """Reward: the share of digits in the reply; graded, so a random tiny model's groups have variance."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "1+1=", {}

    def step(self, action):
        return "", sum(c.isdigit() for c in action) / max(1, len(action)), True, False, {}


def lora_spec(**ppo) -> TrainSpec:
    cfg = TrainConfig()
    for key, value in ppo.items():
        setattr(cfg.ppo, key, value)
    cfg.model.lora = LoraConfig(r=8, alpha=16)
    return TrainSpec.of(cfg, pad_token_id=0)


def trajectories() -> list[Trajectory]:
    """Two groups with reward variance: the update moves the policy."""
    out = []
    for g, reward in [("g", 1.0), ("g", 0.0), ("h", 0.0), ("h", 1.0)]:
        out.append(
            Trajectory(
                [5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 0, 1], [0, 0, -3.0, -3.0, 0, -3.0], [-1, -1, 0, 0, -1, 0], reward, g
            )
        )
    return out


def update(policy) -> dict[str, float]:
    return asyncio.run(policy.update(trajectories(), torch.Generator().manual_seed(0)))


def test_only_the_adapter_trains_and_holds_optimizer_state(tiny_dir):
    policy = load_trainable("policy", lora_spec(), str(tiny_dir), str(tiny_dir))
    base = {k: v.clone() for k, v in policy.model.state_dict().items() if "lora_" not in k}
    adapter = asyncio.run(policy.tensors())
    assert adapter and all("lora_" in k for k in adapter), "the weight source is the adapter alone"
    update(policy)
    after = policy.model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in base.items()), "the base model is frozen"
    moved = asyncio.run(policy.tensors())
    assert any(not torch.equal(adapter[k], moved[k]) for k in adapter), "the adapter moved"
    state = policy.optimizer.state_dict()["state"]
    held = sum(
        t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t) and t.dim()
    )
    assert held == 2 * trainable_bytes(policy.adapter.parameters()) < 0.5 * sum(t.numel() * 4 for t in after.values())


def test_the_kl_reference_is_the_base_with_the_adapter_off(tiny_dir):
    policy = load_trainable("policy", lora_spec(kl_coef=0.1), str(tiny_dir), str(tiny_dir))
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    mb = make_micro_batches(trajectories()[:1], 1024)[0]
    base = token_logprobs(load_model(tiny_dir), mb)
    with torch.no_grad():
        assert not torch.allclose(token_logprobs(policy.model, mb), base, atol=1e-3), "the adapter matters"
        assert torch.allclose(policy.reference(mb), base, atol=1e-5)
        assert not torch.allclose(token_logprobs(policy.model, mb), base, atol=1e-3), "and is on again after"
    assert "kl_ref" in update(policy)


def test_gae_trains_the_critic_s_own_adapter_and_head(tiny_dir):
    policy = load_trainable("policy", lora_spec(advantage="gae"), str(tiny_dir), str(tiny_dir))
    critic = policy.critic
    trained = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or n.startswith("head.") for n in trained)
    head = critic.head.weight.clone()
    update(policy)
    assert not torch.equal(head, critic.head.weight)


def test_a_run_trains_resumes_and_its_checkpoint_loads_with_peft_and_merges(tiny_dir, tmp_path):
    rl = write_rl_config(tmp_path, tiny_dir)
    env = ["env.id=tests.trainers.test_lora:DigitShare", "env.kwargs={}", "eval.env_kwargs={}", "ppo.lr=1e-2"]
    args = ["train", str(rl), "--no-progress", "model.lora.r=16", "save_every=1", "eval.num_problems=1", *env]
    assert main(args) == 0
    ckpt = tmp_path / "rl" / "checkpoints" / "step_2" / "model"
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["base_model_name_or_path"] == str(tiny_dir.resolve())
    assert not (ckpt / "model.safetensors").exists(), "a checkpoint holds the adapter, not the model"
    assert main([*args, "steps=3", "--resume"]) == 0
    ckpt = tmp_path / "rl" / "checkpoints" / "step_3" / "model"
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(load_model(tiny_dir), str(ckpt)).eval()(ids).logits
        assert not torch.allclose(adapted, load_model(tiny_dir)(ids).logits, atol=1e-4), "three steps moved it"
        assert main(["export-lora", str(tmp_path / "rl"), "--merge", str(tmp_path / "merged")]) == 0
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()(ids).logits
    assert torch.allclose(merged, adapted, atol=1e-4)
    assert main(["export-lora", str(tmp_path / "rl"), "--adapter", str(tmp_path / "adapter")]) == 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    again = ["export-lora", str(tmp_path / "rl"), "--adapter", str(tmp_path / "adapter")]
    assert main(again) == 2 and main([*again, "--overwrite"]) == 0  # an earlier export is replaced on request
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")  # not an export: --overwrite leaves it alone
    assert main(["export-lora", str(tmp_path / "rl"), "--merge", str(tmp_path / "mine"), "--overwrite"]) == 2
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert main(["export-lora", str(tiny_dir), "--merge", str(tmp_path / "x")]) == 2  # no checkpoint there


def test_two_adapters_on_one_engine_version_it_as_the_older(tiny_dir):
    """The engine's version (what tags tokens) is the oldest adapter's; each request names its adapter."""
    engine = HFEngine(load_model(tiny_dir))
    group = LoraGroup(engine)
    spec = lora_spec()
    a, b = (load_trainable(n, spec, str(tiny_dir), str(tiny_dir)) for n in ("alice", "bob"))

    async def run():
        for name, policy in (("alice", a), ("bob", b)):
            await group.sync(name).push(policy, 0)
        with torch.no_grad():
            for name, p in a.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.5)
        await group.sync("alice").push(a)
        version_after_a = engine.get_version()
        await group.sync("bob").push(b)
        params = SamplingParams(6, temperature=0.0, ignore_eos=True)
        outs = [await group.view(n).agenerate(GenRequest(f"{n}/t0", [5, 6, 7], params)) for n in ("alice", "bob")]
        await engine.aclose()
        return version_after_a, outs

    version_after_a, (out_a, out_b) = asyncio.run(run())
    assert version_after_a == 0 and engine.get_version() == 1
    assert out_a.output_versions == [1] * 6 and out_a.output_tokens != out_b.output_tokens
    base = load_model(tiny_dir).generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False)[0, 3:]
    assert out_b.output_tokens == base.tolist(), "b's adapter is still zero: the base model's tokens"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.lora.r=8", "policies.a=x"], "policies.AGENT.lora"),
        (["model.lora.r=8", "engine.weight_sync=broadcast", "engine.backend=serve-model"], "weight_sync must be auto"),
        (["model.lora.r=0"], "model.lora"),
        (["policies.a.lora.r=8", "policies.a.path=x", "policies.b.lora.r=8", "policies.b.path=y"], "one base"),
        (["model.lora.target_modules=[]"], "target_modules"),
    ],
)
def test_lora_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, None, ["model.path=m", *overrides])


@pytest.mark.slow
def test_a_run_on_serve_model_pushes_the_adapter_alone(tiny_dir, tmp_path):
    """Through disk to a real serve-model: each push writes PEFT's directory and the server loads it by name
    (SGLang's /load_lora_adapter); the bytes logged are the adapter's, a fraction of the model's."""
    from safetensors.torch import load_file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rl = write_rl_config(tmp_path, tiny_dir)
    env = ["env.id=tests.trainers.test_lora:DigitShare", "env.kwargs={}", "eval.env_kwargs={}", "eval.num_problems=1"]
    assert main(["train", str(rl), "--no-progress", "model.lora.r=8", "engine.backend=serve-model", *env]) == 0
    run = tmp_path / "rl"
    adapter = run / "engine_weights" / "lora" / "policy" / "v2" / "adapter_model.safetensors"
    pushed = EventAccumulator(str(run / "tensorboard")).Reload().Scalars("perf/weight_sync_bytes")
    assert [e.value for e in pushed] == [float(adapter.stat().st_size)] * 2
    model_bytes = (tiny_dir / "model.safetensors").stat().st_size
    assert adapter.stat().st_size < 0.5 * model_bytes
    assert all("lora_" in k for k in load_file(adapter))
    assert json.loads((run / "summary.json").read_text())["engine_version"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("trainer", [["ppo.trainer=process"], ["ppo.nproc_per_node=2", "ppo.kl_coef=0.1"]])
def test_lora_in_a_trainer_process_and_on_fsdp2_ranks(tiny_dir, tmp_path, trainer):
    """The adapter trains in a trainer process of its own, and sharded over two FSDP2 ranks (gloo; the KL
    reference through the sharded root with the adapter off): the pushes and the checkpoint are the adapter
    alone, gathered from the shards, and a resume continues its optimizer."""
    from safetensors.torch import load_file

    rl = write_rl_config(tmp_path, tiny_dir)
    env = ["env.id=tests.trainers.test_lora:DigitShare", "env.kwargs={}", "eval.env_kwargs={}", "eval.num_problems=1"]
    args = ["train", str(rl), "--no-progress", "model.lora.r=8", "ppo.lr=1e-2", *env, *trainer]
    assert main(args) == 0
    ckpt = tmp_path / "rl" / "checkpoints" / "step_2"
    adapter = load_file(ckpt / "model" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k), "the adapter did not train"
    with torch.no_grad():
        PeftModel.from_pretrained(load_model(tiny_dir), str(ckpt / "model"))  # loads as PEFT's own
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)["optimizer"]["state"]
    assert len(state) == len(adapter)  # optimizer state for the adapter's tensors alone
    assert main([*args, "steps=3", "--resume"]) == 0
    state = torch.load(tmp_path / "rl" / "checkpoints" / "step_3" / "trainer_state.pt", weights_only=False)
    steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert len(steps) == 1 and steps.pop() >= 3.0  # continued from the checkpoint's 2 (a fresh optimizer says 1)
