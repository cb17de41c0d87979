"""`ProcessPolicy`: PPO updates in a spawned trainer process, weights back through shared memory."""

import asyncio
import os
import random
import signal

import pytest
import torch

from areal_agents.config import TrainConfig
from areal_agents.engines import HFEngine
from areal_agents.models import load_model
from areal_agents.trainers.policy import load_trainable
from areal_agents.trainers.trainer_process import ProcessPolicy, TrainerProcessError
from areal_agents.types import Trajectory


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
def cfg(tiny_dir):
    cfg = TrainConfig()
    cfg.model.path = str(tiny_dir)
    cfg.ppo.lr, cfg.ppo.num_minibatches = 1e-3, 2  # two optimizer steps: a proximal pass and a schedule
    return cfg


def test_an_update_in_the_process_equals_one_in_this_process(cfg, tiny_dir):
    trajectories = batch(load_model(tiny_dir).config.vocab_size)
    here = load_trainable("policy", cfg, str(tiny_dir), str(tiny_dir))
    expected = here.train_step(trajectories, cfg, 0, torch.Generator().manual_seed(5))

    engine = HFEngine(load_model(tiny_dir))
    policy = ProcessPolicy("policy", cfg, str(tiny_dir), str(tiny_dir), engine, None, threads=torch.get_num_threads())
    try:
        generator = torch.Generator().manual_seed(5)
        stats = asyncio.run(policy.update(trajectories, cfg, 0, generator))
        assert not torch.equal(generator.get_state(), torch.Generator().manual_seed(5).get_state())  # handed back
        asyncio.run(policy.push_weights())
        state = policy.train_state()
        trained = policy.model.state_dict()
    finally:
        policy.close()
    assert not policy._process.is_alive()
    assert stats["optimizer_steps"] == expected["optimizer_steps"] == 2
    assert stats["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    for key, value in here.model.state_dict().items():
        assert torch.allclose(trained[key], value, atol=1e-5), key
        assert torch.equal(engine.model.state_dict()[key], trained[key]), key  # what the engine now serves
    assert engine.get_version() == 1
    assert state["scheduler"]["last_epoch"] == 2 and state["optimizer"]["state"]


def test_an_update_that_raises_names_the_error_and_the_process_lives_on(cfg, tiny_dir):
    engine = HFEngine(load_model(tiny_dir))
    policy = ProcessPolicy("policy", cfg, str(tiny_dir), str(tiny_dir), engine, None, threads=1)
    try:
        bad = batch(10**6)  # token ids past the vocabulary
        with pytest.raises(TrainerProcessError, match="failed in update:(.|\n)*IndexError"):
            asyncio.run(policy.update(bad, cfg, 0, torch.Generator()))
        good = batch(load_model(tiny_dir).config.vocab_size)
        assert asyncio.run(policy.update(good, cfg, 0, torch.Generator()))["trained_trajectories"] == 12

        os.kill(policy._process.pid, signal.SIGKILL)
        policy._process.join()
        with pytest.raises(TrainerProcessError, match="trainer process 'policy' (died|is gone)"):
            asyncio.run(policy.update(good, cfg, 0, torch.Generator()))
    finally:
        policy.close()
