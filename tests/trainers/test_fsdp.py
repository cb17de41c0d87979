"""FSDP2 on two gloo ranks (real processes, torchrun's environment) takes the single-process trainer's steps,
and a 2-rank checkpoint resumes on 1 rank and on 2. One spawn of two processes runs every case."""

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group

from areal_agents.config import PPOConfig
from areal_agents.models import load_model
from areal_agents.net import free_port
from areal_agents.trainers.distributed import DataParallel, model_flops
from areal_agents.trainers.policy import load_trainable
from areal_agents.trainers.policy_api import TrainSpec
from tests.trainers.test_distributed import _batch

CONFIGS = {
    "grpo, 2 minibatches x 2 epochs (proximal pass, padding), shared prompts": dict(
        num_minibatches=2, ppo_epochs=2, micro_batch_tokens=96
    ),
    "gae critic, packed": dict(advantage="gae", micro_batch_tokens=128, share_prompts=False),
    "kl to reference (sharded), padded, activation checkpointing": dict(
        kl_coef=0.1, micro_batch_tokens=64, packing=False, activation_checkpointing=True
    ),
}
RESUMED = next(iter(CONFIGS))  # the config whose checkpoint after step 1 is resumed


def _spec(kwargs: dict) -> TrainSpec:
    return TrainSpec(PPOConfig(lr=1e-3, device="cpu", **kwargs), 1.0, 0, "float32", total_steps=4)


def _weights(policy) -> dict:
    out = dict(policy.weights())
    if policy.critic is not None:
        state = policy.state_dict()["critic"]
        out |= {f"critic.{k}": v for k, v in state.items()}
    return out


def _steps(policy, generator: torch.Generator, n: int) -> list[dict]:
    return [policy.train_step(_batch(), generator) for _ in range(n)]


def _checkpoint(policy, tiny_dir, out) -> None:
    """Rank 0 writes what a run's checkpoint holds: the model directory and the train state (all ranks gather)."""
    weights, state = policy.weights(), policy.state_dict()
    if policy.dp is None or policy.dp.rank == 0:
        model = load_model(tiny_dir)
        model.load_state_dict(weights)
        model.save_pretrained(out / "model")
        torch.save(state, out / "trainer_state.pt")


def _count_reduce_scatters() -> list[int]:
    """Count FSDP2's gradient reduce-scatters from now on (one call per sharded module per backward that
    syncs) into the one-item list returned."""
    count = [0]
    reduce = param_group.foreach_reduce

    def counted(*args, **kwargs):
        count[0] += 1
        return reduce(*args, **kwargs)

    param_group.foreach_reduce = counted
    return count


def _sharded_modules(policy) -> int:
    trained = [policy.trained] + ([policy.critic] if policy.critic is not None else [])
    return sum(isinstance(m, FSDPModule) for module in trained for m in module.modules())


def _rank(rank: int, port: int, tiny_dir, out) -> None:
    os.environ |= {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.set_num_threads(1)
    dp = DataParallel.from_env(torch.device("cpu"))
    results = {}
    reduces = _count_reduce_scatters()
    try:
        for name, kwargs in CONFIGS.items():
            torch.manual_seed(0)
            policy = load_trainable("policy", _spec(kwargs), str(tiny_dir), str(tiny_dir), dp)
            generator = torch.Generator().manual_seed(3)
            reduces[0] = 0
            stats = _steps(policy, generator, 1)
            # (reduce-scatters, optimizer steps, sharded modules trained) of the first step
            results[f"{name} reduces"] = (reduces[0], stats[0]["optimizer_steps"], _sharded_modules(policy))
            if name == RESUMED:
                _checkpoint(policy, tiny_dir, out)
                torch.save(generator.get_state(), out / "generator.pt")
            stats += _steps(policy, generator, 1)
            results[name] = {"weights": _weights(policy), "stats": stats}
            if name == RESUMED:
                resumed = load_trainable("policy", _spec(kwargs), str(out / "model"), str(tiny_dir), dp)
                resumed.load_state_dict(torch.load(out / "trainer_state.pt", weights_only=False))
                generator = torch.Generator()
                generator.set_state(torch.load(out / "generator.pt"))
                stats = _steps(resumed, generator, 1)
                results["resumed on 2"] = {"weights": _weights(resumed), "stats": stats}
        if rank == 0:
            torch.save(results, out / "ranks.pt")
    finally:
        dp.close()


@pytest.fixture(scope="module")
def two_ranks(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_rank, args=(free_port("127.0.0.1"), tiny_dir, out), nprocs=2)
    return out, torch.load(out / "ranks.pt", weights_only=False)


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-5, msg=f"{what}: {k}")


@pytest.mark.process
@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_fsdp_ranks_take_the_single_process_steps(two_ranks, tiny_dir, name):
    _, ranks = two_ranks
    torch.manual_seed(0)
    single = load_trainable("policy", _spec(CONFIGS[name]), str(tiny_dir), str(tiny_dir))
    stats = _steps(single, torch.Generator().manual_seed(3), 2)
    start = load_model(tiny_dir).state_dict()
    assert any(not torch.equal(single.model.state_dict()[k], start[k]) for k in start)  # the steps changed it
    _assert_same(ranks[name]["weights"], _weights(single), name)
    for step, (got, want) in enumerate(zip(ranks[name]["stats"], stats)):
        for key in ("loss", "grad_norm", "clip_fraction", "behav_weight_max", "trained_trajectories", "kl_ref"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (name, step, key)
        # the work of the whole update, summed over the ranks (padding excluded)
        assert got["trained_tokens"] == want["trained_tokens"] > 0
        assert got["model_flops"] == pytest.approx(want["model_flops"])
        assert got["peak_flops"] == want["peak_flops"] == 0.0  # a CPU has no known peak
    if "critic" in name:
        assert ranks[name]["stats"][0]["critic_grad_norm"] == pytest.approx(stats[0]["critic_grad_norm"], rel=1e-4)


@pytest.mark.process
@pytest.mark.parametrize("name", list(CONFIGS))
def test_ranks_reduce_scatter_gradients_once_per_optimizer_step(two_ranks, name):
    """Each sharded module's gradients are summed across the ranks in the last micro-batch's backward of an
    optimizer step (`fsdp.gradient_sync`), not in every micro-batch's: these configs run several a step."""
    _, ranks = two_ranks
    reduces, steps, modules = ranks[f"{name} reduces"]
    assert modules >= 3 and steps >= 1
    assert reduces == steps * modules


@pytest.mark.process
def test_a_two_rank_checkpoint_resumes_on_two_ranks_and_on_one(two_ranks, tiny_dir):
    out, ranks = two_ranks
    continued = ranks[RESUMED]
    _assert_same(ranks["resumed on 2"]["weights"], continued["weights"], "resumed on 2 ranks")
    one = load_trainable("policy", _spec(CONFIGS[RESUMED]), str(out / "model"), str(tiny_dir))
    one.load_state_dict(torch.load(out / "trainer_state.pt", weights_only=False))
    generator = torch.Generator()
    generator.set_state(torch.load(out / "generator.pt"))
    stats = _steps(one, generator, 1)
    _assert_same(_weights(one), continued["weights"], "resumed on 1 rank")
    assert stats[0]["loss"] == pytest.approx(continued["stats"][1]["loss"], rel=1e-4, abs=1e-6)


def test_model_flops_is_the_palm_count():
    # 10 tokens of a 1,000-parameter model with 2 layers of width 8, two sequences of 4 and 6 tokens:
    # 6 * 1000 * 10 = 60,000 for the matmuls; attended 4*5/2 + 6*7/2 = 31 positions, 12 * 2 * 8 * 31 = 5,952
    assert model_flops(10, 1000, 2, 8, 4 * 5 / 2 + 6 * 7 / 2) == 60_000 + 5_952
