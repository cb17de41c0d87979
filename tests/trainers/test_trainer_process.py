"""`RemotePolicy` over a `PipeTransport`: PPO updates in a spawned trainer process, weights back through shared
memory, files written by the trainer process."""

import asyncio
import os
import random
import signal
from dataclasses import replace

import pytest
import torch

from areal_agents.config import TrainConfig
from areal_agents.engines import HFEngine
from areal_agents.engines.serving import Serving
from areal_agents.engines.weight_sync import InProcessSync
from areal_agents.models import load_model
from areal_agents.trainers.checkpoint import load_trainer_state
from areal_agents.trainers.policy import load_trainable
from areal_agents.trainers.policy_api import TrainablePolicy, TrainSpec
from areal_agents.trainers.remote_policy import RemotePolicy
from areal_agents.trainers.run_state import save_run
from areal_agents.trainers.trainer_process import PipeTransport, TrainerProcessError
from areal_agents.types import Trajectory

pytestmark = pytest.mark.process


def batch(vocab: int, n_groups: int = 3, group_size: int = 4) -> list[Trajectory]:
    rng = random.Random(0)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(3, vocab) for _ in range(6)]
        for i in range(group_size):
            answer = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 5))]
            n = len(prompt) + len(answer)
            out.append(
                Trajectory(
                    input_ids=prompt + answer,
                    loss_mask=[0] * len(prompt) + [1] * len(answer),
                    logprobs=[0.0] * len(prompt) + [-2.0] * len(answer),
                    versions=[-1] * len(prompt) + [0] * len(answer),
                    reward=float(i % 2),
                    group_id=str(g),
                    episode_id=f"{g}/{i}",
                )
            )
            assert len(out[-1]) == n
    return out


@pytest.fixture
def spec(tiny_dir):
    cfg = TrainConfig()
    cfg.model.path = str(tiny_dir)
    cfg.ppo.lr, cfg.ppo.num_minibatches = 1e-3, 2  # two optimizer steps: a proximal pass and a schedule
    return TrainSpec.of(cfg, pad_token_id=0)


def process_policy(name: str, spec: TrainSpec, tiny_dir, engine: HFEngine) -> RemotePolicy:
    """A policy trained in a process of its own, its weights swapped into ``engine`` in place."""
    transport = PipeTransport.spawn(spec, name, str(tiny_dir), str(tiny_dir))
    return RemotePolicy(name, spec, Serving(engine, InProcessSync([engine]), None), transport)


def test_an_update_in_the_process_equals_one_in_this_process(spec, tiny_dir, tmp_path):
    trajectories = batch(load_model(tiny_dir).config.vocab_size)
    here = load_trainable("policy", spec, str(tiny_dir), str(tiny_dir))
    expected = here.train_step(trajectories, torch.Generator().manual_seed(5))

    engine = HFEngine(load_model(tiny_dir))
    policy = process_policy("policy", spec, tiny_dir, engine)
    assert isinstance(policy, TrainablePolicy) and policy.streams
    try:
        generator = torch.Generator().manual_seed(5)
        stats = asyncio.run(policy.update(trajectories, generator))
        assert not torch.equal(generator.get_state(), torch.Generator().manual_seed(5).get_state())  # handed back
        asyncio.run(policy.push_weights())
        state = policy.state_dict()
        policy.save_checkpoint(tmp_path / "model")  # written by the trainer process
        trained = load_model(tmp_path / "model").state_dict()
    finally:
        policy.close()
    assert not policy.transport.processes[0].is_alive()
    assert stats["optimizer_steps"] == expected["optimizer_steps"] == 2
    assert stats["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    for key, value in here.model.state_dict().items():
        assert torch.allclose(trained[key], value, atol=1e-5), key
        assert torch.equal(engine.model.state_dict()[key], trained[key]), key  # what the engine now serves
    assert engine.get_version() == 1
    assert state["scheduler"]["last_epoch"] == 2 and state["optimizer"]["state"]


def test_a_checkpoint_is_written_by_the_trainer_process_in_the_usual_layout(spec, tiny_dir, tokenizer, tmp_path):
    """`save_run` of separate policies: each trainer process writes its model directory and adds its train state
    under ``trainer_state.pt["policies"][name]``, beside the run's own state; the checkpoint loads as before."""
    engine = HFEngine(load_model(tiny_dir))
    policy = process_policy("a", spec, tiny_dir, engine)
    try:
        asyncio.run(policy.update(batch(load_model(tiny_dir).config.vocab_size), torch.Generator().manual_seed(5)))
        ckpt = save_run(tmp_path, 1, {"a": policy}, tokenizer, {"data_position": 3}, keep=0)
        state, weights = policy.state_dict(), {k: v.clone() for k, v in asyncio.run(policy.tensors()).items()}
    finally:
        policy.close()
    saved = load_trainer_state(ckpt)
    assert saved["step"] == 1 and saved["data_position"] == 3 and set(saved["policies"]) == {"a"}
    assert saved["policies"]["a"]["scheduler"] == state["scheduler"] and state["scheduler"]["last_epoch"] == 2
    for i, moments in state["optimizer"]["state"].items():
        assert torch.equal(saved["policies"]["a"]["optimizer"]["state"][i]["exp_avg"], moments["exp_avg"]), i
    model = load_model(ckpt / "policies" / "a" / "model")
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key
    assert (ckpt / "policies" / "a" / "model" / "tokenizer_config.json").is_file()


def test_an_update_that_raises_names_the_error_and_the_process_lives_on(spec, tiny_dir):
    engine = HFEngine(load_model(tiny_dir))
    spec = replace(spec, cpu_threads=1)
    policy = process_policy("policy", spec, tiny_dir, engine)
    try:
        bad = batch(10**6)  # token ids past the vocabulary
        with pytest.raises(TrainerProcessError, match="failed in update:(.|\n)*IndexError"):
            asyncio.run(policy.update(bad, torch.Generator()))
        good = batch(load_model(tiny_dir).config.vocab_size)
        assert asyncio.run(policy.update(good, torch.Generator()))["trained_trajectories"] == 12

        os.kill(policy.transport.processes[0].pid, signal.SIGKILL)
        policy.transport.processes[0].join()
        with pytest.raises(TrainerProcessError, match="trainer process 'policy' (died|is gone)"):
            asyncio.run(policy.update(good, torch.Generator()))
    finally:
        policy.close()
