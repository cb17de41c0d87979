"""Data-parallel PPO: two gloo ranks (real processes) take the same step as one process on the same batch."""

import random

import pytest
import torch
import torch.multiprocessing as mp

from areal_agents.config import PPOConfig
from areal_agents.models import load_model
from areal_agents.net import free_port
from areal_agents.trainers.batching import make_micro_batches
from areal_agents.trainers.critic import ValueModel
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.optim import make_optimizer
from areal_agents.trainers.ppo import ppo_update
from areal_agents.types import Trajectory


def _batch() -> list[Trajectory]:
    """8 groups of 4 (each sharing its prompt) with mixed lengths and rewards (some zero-variance groups)."""
    rng = random.Random(0)
    out = []
    for g in range(8):
        prompt_ids = [rng.randint(5, 60) for _ in range(rng.randint(3, 12))]
        for e in range(4):
            prompt, gen = len(prompt_ids), rng.randint(1, 20)
            ids = prompt_ids + [rng.randint(5, 60) for _ in range(gen)]
            mask = [0] * prompt + [1] * gen
            logp = [0.0] * prompt + [-rng.uniform(0.5, 4.0) for _ in range(gen)]
            versions = [-1] * prompt + [0] * gen
            reward = 1.0 if g % 3 == 0 else float(rng.random() < 0.5)
            out.append(Trajectory(ids, mask, logp, versions, reward, f"g{g}", episode_id=f"g{g}/e{e}"))
    return out


CONFIGS = {
    "grpo, 2 minibatches, proximal pass, shared prompts": dict(num_minibatches=2, ppo_epochs=2, micro_batch_tokens=96),
    "gae critic, packed": dict(advantage="gae", micro_batch_tokens=128, share_prompts=False),
    "kl to reference, one step, padded": dict(kl_coef=0.1, micro_batch_tokens=64, packing=False),
}


def _train(tiny_dir, cfg: PPOConfig, dp: DataParallel | None) -> dict:
    torch.manual_seed(0)
    model = load_model(tiny_dir)
    optimizer, scheduler = make_optimizer(model, cfg.lr, 0.0, 0)
    critic = critic_optimizer = ref = None
    if cfg.advantage == "gae":
        critic = ValueModel(load_model(tiny_dir))
        critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr)
    if cfg.kl_coef:
        ref = load_model(tiny_dir).eval()
    stats = ppo_update(
        model, optimizer, scheduler, _batch(), cfg, temperature=1.0, pad_token_id=0,
        generator=torch.Generator().manual_seed(3), ref_model=ref, critic=critic,
        critic_optimizer=critic_optimizer, dp=dp,
    )  # fmt: skip
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    if critic is not None:
        weights |= {f"critic.{k}": v.clone() for k, v in critic.state_dict().items()}
    return {"weights": weights, "stats": stats}


def _rank(rank: int, world: int, master: str, tiny_dir, kwargs: dict, out) -> None:
    torch.set_num_threads(1)
    dp = DataParallel.init(rank, world, master)
    try:
        result = _train(tiny_dir, PPOConfig(lr=1e-3, **kwargs), dp)
        if rank == 0:
            torch.save(result, out)
    finally:
        dp.close()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_gloo_ranks_take_the_single_process_step(tiny_dir, tmp_path, name):
    kwargs = CONFIGS[name]
    single = _train(tiny_dir, PPOConfig(lr=1e-3, **kwargs), None)
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(2, f"127.0.0.1:{free_port('127.0.0.1')}", tiny_dir, kwargs, out), nprocs=2)
    parallel = torch.load(out, weights_only=False)
    start = load_model(tiny_dir).state_dict()
    assert any(not torch.equal(single["weights"][k], start[k]) for k in start)  # the step changed the model
    for k, w in single["weights"].items():
        torch.testing.assert_close(parallel["weights"][k], w, rtol=0, atol=1e-5, msg=f"{name}: {k}")
    for key in ("loss", "grad_norm", "clip_fraction", "behav_weight_max", "trained_trajectories"):
        assert parallel["stats"][key] == pytest.approx(single["stats"][key], rel=1e-4, abs=1e-6), key


def test_share_balances_tokens_and_covers_every_micro_batch():
    trajs = _batch()
    mbs = make_micro_batches(trajs, 64, pad_token_id=0)
    shares = [DataParallel(r, 3).share(mbs) for r in range(3)]
    assert sorted(id(mb) for s in shares for mb in s) == sorted(id(mb) for mb in mbs)  # each exactly once
    loads = [sum(mb.input_ids.numel() for mb in s) for s in shares]
    assert max(loads) - min(loads) <= max(mb.input_ids.numel() for mb in mbs)
