"""Two gloo ranks build the policy, its reference and its critic on the meta device and load them from rank 0:
rank 1 is given a copy of the checkpoint with its config alone (no weight file), so a read there would fail,
and every model's shards hold the checkpoint's weights, the head still tied to the embedding and the rotary
frequencies as the loader computes them."""

import os
import shutil
import threading

import pytest
import torch
import torch.multiprocessing as mp

from areal_agents.config import PPOConfig
from areal_agents.models.loading import empty_model, load_model, params_on_meta
from areal_agents.net import free_port
from areal_agents.trainers import fsdp
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.policy import load_trainable
from areal_agents.trainers.policy_api import TrainSpec

SPEC = TrainSpec(
    PPOConfig(device="cpu", kl_coef=0.1, advantage="gae", activation_checkpointing=True), 1.0, 0, "float32", 1
)


def _lm_checks(root, want: torch.nn.Module) -> dict:
    """On this rank: whether ``root``'s LM head is its embedding, and its rotary frequencies against ``want``'s."""
    lm = root.lm
    inv_freq, wanted = lm.model.rotary_emb.inv_freq, want.model.rotary_emb.inv_freq
    return {"tied": lm.lm_head.weight is lm.model.embed_tokens.weight, "inv_freq": torch.equal(inv_freq, wanted)}


def _rank(rank: int, port: int, paths: list, out) -> None:
    os.environ |= {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.set_num_threads(1)
    dp = DataParallel.from_env(torch.device("cpu"))
    try:
        path = str(paths[rank])
        policy = load_trainable("policy", SPEC, path, path, dp)
        want = load_model(paths[0])  # the checkpoint, for the rotary buffers each rank computed
        checks = {"policy": _lm_checks(policy.trained, want), "reference": _lm_checks(policy.reference, want)}
        body = policy.critic.body.rotary_emb.inv_freq
        checks["critic"] = {"inv_freq": torch.equal(body, want.model.rotary_emb.inv_freq)}
        gathered = {
            "policy": fsdp.full_state_dict(policy.trained),
            "reference": fsdp.full_state_dict(policy.reference),
            "critic": fsdp.full_state_dict(policy.critic),
        }
        torch.save({"checks": checks, "gathered": gathered}, out / f"rank{rank}.pt")
    finally:
        dp.close()


@pytest.fixture(scope="module")
def loaded(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("meta_load")
    config_only = out / "config_only"
    config_only.mkdir()
    for name in ("config.json", "generation_config.json"):
        if (tiny_dir / name).is_file():
            shutil.copy(tiny_dir / name, config_only / name)
    mp.spawn(_rank, args=(free_port("127.0.0.1"), [tiny_dir, config_only], out), nprocs=2)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.process
def test_ranks_load_their_shards_from_rank_0_alone(loaded, tiny_dir):
    want = load_model(tiny_dir).state_dict()
    gathered = loaded[0]["gathered"]
    for name in ("policy", "reference"):
        assert gathered[name].keys() == want.keys(), name
        for key, value in want.items():
            assert torch.equal(gathered[name][key], value), (name, key)
    critic = gathered["critic"]
    body = {k.removeprefix("model."): v for k, v in want.items() if k.startswith("model.")}
    assert critic.keys() == {f"body.{k}" for k in body} | {"head.weight", "head.bias"}
    for key, value in body.items():
        assert torch.equal(critic[f"body.{key}"], value), key
    assert not critic["head.weight"].any() and not critic["head.bias"].any()  # values start at 0
    for rank in loaded:
        assert rank["checks"]["policy"] == rank["checks"]["reference"] == {"tied": True, "inv_freq": True}
        assert rank["checks"]["critic"] == {"inv_freq": True}


def test_an_empty_model_is_the_loaded_one_without_weights(tiny_dir):
    empty, loaded = empty_model(tiny_dir), load_model(tiny_dir)
    params = dict(empty.named_parameters())
    assert params.keys() == dict(loaded.named_parameters()).keys()
    assert all(p.is_meta for p in params.values())
    assert {k: p.dtype for k, p in params.items()} == {k: p.dtype for k, p in loaded.named_parameters()}
    assert empty.lm_head.weight is empty.model.embed_tokens.weight
    assert torch.equal(empty.model.rotary_emb.inv_freq, loaded.model.rotary_emb.inv_freq)  # a real buffer
    assert empty.config._attn_implementation == loaded.config._attn_implementation
    assert empty.generation_config.to_dict() == loaded.generation_config.to_dict()


def test_params_go_to_meta_in_the_building_thread_alone():
    built = {}
    with params_on_meta():
        built["here"] = torch.nn.Linear(2, 2)
        other = threading.Thread(target=lambda: built.update(there=torch.nn.Linear(2, 2)))
        other.start()
        other.join()
    assert built["here"].weight.is_meta and not built["there"].weight.is_meta
    assert not torch.nn.Linear(2, 2).weight.is_meta  # after the block too
