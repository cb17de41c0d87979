"""Weight updates are all or nothing (issue 42, item 3): a checkpoint on disk (through serve-model's HTTP
/update_weights_from_disk), a state dict in process (copied or shared), a ProcessEngine's pipe and a gloo
broadcast are read and checked whole before any live weight changes. Each refused update must leave the
served greedy tokens and logprobs bit-identical and the version as it was, and say what was wrong (file,
key) without quoting the file; the new weights are always other weights than the served ones, so any
tensor loaded before the refusal shows in the logprobs."""

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest
import torch
from app_in_thread import serving_app

from areal_agents.config import EngineOptions
from areal_agents.engines.broadcast_group import join_group
from areal_agents.engines.broadcast_sync import BroadcastSync
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.model_server import ModelServerConfig, build_app
from areal_agents.engines.sglang.client import SGLangEngine
from areal_agents.engines.weight_sender import HeldWeights
from areal_agents.engines.weight_sync import write_weights
from areal_agents.errors import EngineError
from areal_agents.models import load_model, load_tokenizer
from areal_agents.net import free_port
from areal_agents.types import GenRequest, SamplingParams

PROMPT = [5, 17, 23, 42, 8, 9, 60, 3]
SECRET = "hunter2-do-not-echo"  # planted in bad files: no error may quote it
NORM = "model.norm.weight"  # the last tensor in the state dict's order: the others load first on a partial update


@pytest.fixture(scope="module")
def new_state(tiny_dir) -> dict[str, torch.Tensor]:
    """Other weights than the tiny model's (every tensor moved), in its state dict's order."""
    model = load_model(tiny_dir)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return {k: v.clone() for k, v in model.state_dict().items()}


def moved(state: dict, seed: int) -> dict[str, torch.Tensor]:
    """``state`` with every tensor moved again: a refused update's weights differ from whatever is served, so
    any tensor of them loaded before the refusal shows in the logprobs."""
    generator = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=generator) * 0.05 for k, v in state.items()}


def altered(state: dict, **changes) -> dict:
    """``state`` with tensors replaced (None: removed); keys spelled with ``__`` for dots."""
    out = dict(state)
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            out.pop(key)
        else:
            out[key] = value
    return out


def with_nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[-1] = float("nan")
    return t


# ---- bad checkpoint directories: (how to write one, what the error must say) -----------------------------


def unknown_key(state, path):
    write_weights({**state, "model.layers.1.mlp.gate_proj.extra": torch.zeros(4)}, path)


def wrong_shape(state, path):
    write_weights(altered(state, model__norm__weight=state[NORM][:-1].clone()), path)


def nan_value(state, path):
    write_weights(altered(state, model__norm__weight=with_nan(state[NORM])), path)


def int_dtype(state, path):
    write_weights(altered(state, model__norm__weight=torch.ones(state[NORM].shape, dtype=torch.int64)), path)


def missing_key(state, path):
    write_weights(altered(state, model__layers__1__post_attention_layernorm__weight=None), path)


def sharded(state, path):
    """Shards of ~the size of one layer: the model's tensors in several files, with an index."""
    write_weights(state, path, shard_bytes=80_000)
    return sorted(path.glob("model-*.safetensors"))


def missing_shard(state, path):
    shards = sharded(state, path)
    assert len(shards) >= 3
    shards[-1].unlink()


def truncated_shard(state, path):
    last = sharded(state, path)[-1]
    last.write_bytes(last.read_bytes()[:-64])


def index_outside(state, path):
    sharded(state, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][NORM] = "../elsewhere.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def secret_header(state, path):
    """A model.safetensors whose header is JSON, but not safetensors' (it quotes the file's text back)."""
    header = json.dumps({SECRET: SECRET}).encode()
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)


def unnumbered_gap(state, path):
    """Numbered shards without an index, one of them gone."""
    missing_shard(state, path)
    (path / "model.safetensors.index.json").unlink()


BAD_CHECKPOINTS = {
    "unknown key": (unknown_key, "'model.layers.1.mlp.gate_proj.extra' is not a weight of the served model"),
    "wrong shape": (wrong_shape, f"'{NORM}' has shape [63], the served model's is [64]"),
    "NaN": (nan_value, f"'{NORM}' has NaN or infinite values"),
    "int dtype": (int_dtype, f"'{NORM}' is int64, which does not load into the served model's float32"),
    "missing key": (missing_key, "'model.layers.1.post_attention_layernorm.weight' is missing"),
    "missing shard": (missing_shard, "missing shard model-0000"),
    "truncated file": (truncated_shard, "is truncated"),
    "index outside": (index_outside, "something other than a .safetensors file of the directory"),
    "corrupt header": (secret_header, "model.safetensors is not a safetensors file"),
    "numbered gap": (unnumbered_gap, "missing shard model-0000"),
}


@pytest.fixture(scope="module")
def served(tiny_dir):
    """serve-model's app under uvicorn in this process (real HTTP): the URL and its engine."""
    engine = HFEngine(load_model(tiny_dir), eos_token_ids=[], num_threads=1)
    app = build_app(engine, load_tokenizer(tiny_dir), ModelServerConfig(model_path=str(tiny_dir)))
    with serving_app(app) as url:
        yield url, engine
    engine.close()


def call(url: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def greedy(url: str) -> tuple[list[int], list[float], str]:
    """(tokens, logprobs, weight_version) of a greedy /generate of the fixed prompt (JSON floats round-trip
    exactly, so equal lists mean bit-identical logprobs)."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "return_logprob": True}
    status, reply = call(url, "/generate", body)
    assert status == 200, reply
    triples = reply["meta_info"]["output_token_logprobs"]
    return [t[1] for t in triples], [t[0] for t in triples], reply["meta_info"]["weight_version"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_a_refused_checkpoint_leaves_the_served_weights_and_version_as_they_were(served, new_state, tmp_path, case):
    url, _ = served
    write, said = BAD_CHECKPOINTS[case]
    write(moved(new_state, seed=list(BAD_CHECKPOINTS).index(case)), tmp_path)
    before = greedy(url)
    status, reply = call(url, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "v-bad"})
    assert status == 400 and reply["success"] is False, reply
    assert greedy(url) == before, f"a refused update changed the served weights or the version: {reply}"
    assert said in reply["message"] and "nothing was loaded" in reply["message"], reply["message"]
    assert SECRET not in reply["message"] and str(tmp_path) in reply["message"]


def test_the_engine_refuses_each_bad_checkpoint_before_loading_any_of_it(tiny_dir, new_state, tmp_path):
    """The same refusals in process, without the server: `HFEngine.update_weights_from_disk` itself."""
    engine = HFEngine(load_model(tiny_dir), eos_token_ids=[], num_threads=1)

    async def run():
        before = await engine_greedy(engine)
        for i, (case, (write, said)) in enumerate(BAD_CHECKPOINTS.items()):
            path = tmp_path / case.replace(" ", "_")
            path.mkdir()
            write(moved(new_state, seed=i), path)
            with pytest.raises(EngineError, match="update_weights_from_disk: ") as refused:
                await engine.update_weights_from_disk(str(path), version=5)
            assert await engine_greedy(engine) == before, case
            assert said in str(refused.value) and SECRET not in str(refused.value), case

    try:
        asyncio.run(run())
    finally:
        engine.close()


@pytest.mark.slow
def test_a_good_checkpoint_after_refused_ones_loads_whole(served, new_state, tmp_path):
    """The bad cases above are other weights than the served ones: the same weights, written whole, load."""
    url, engine = served
    before = greedy(url)
    sharded(new_state, tmp_path)
    status, reply = call(url, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "v-good"})
    assert status == 200 and reply["success"] is True, reply
    tokens, logprobs, name = greedy(url)
    assert name == "v-good" and logprobs != before[1]
    for key, t in new_state.items():
        assert torch.equal(engine.model.state_dict()[key], t), key


# ---- a state dict in this process --------------------------------------------------------------------------


async def engine_greedy(engine) -> tuple[list[int], list[float], int]:
    r = await engine.agenerate(GenRequest("g", PROMPT, SamplingParams(8, temperature=0)))
    return r.output_tokens, r.output_logprobs, engine.get_version()


def bad_state_dicts(state: dict) -> dict[str, tuple[dict, str]]:
    return {
        "unknown key": ({**state, "model.extra": torch.zeros(3)}, "'model.extra' is not a weight of the served model"),
        "wrong shape": (altered(state, model__norm__weight=torch.ones(65)), f"'{NORM}' has shape [65]"),
        "NaN": (altered(state, model__norm__weight=with_nan(state[NORM])), f"'{NORM}' has NaN or infinite"),
        "inf": (altered(state, model__norm__weight=state[NORM] / 0), f"'{NORM}' has NaN or infinite"),
        "missing key": (altered(state, model__norm__weight=None), f"'{NORM}' is missing"),
        "not a tensor": (altered(state, model__norm__weight=[1.0] * 64), f"'{NORM}' is not a tensor but a list"),
        "int dtype": (altered(state, model__norm__weight=torch.ones(64, dtype=torch.int32)), "is int32"),
    }


@pytest.mark.parametrize("share_weights", [False, True])
def test_a_refused_state_dict_leaves_the_engine_as_it_was(tiny_dir, new_state, share_weights):
    engine = HFEngine(load_model(tiny_dir), eos_token_ids=[], num_threads=1, share_weights=share_weights)

    async def run():
        before = await engine_greedy(engine)
        for i, case in enumerate(bad_state_dicts(new_state)):
            state, said = bad_state_dicts(moved(new_state, seed=i))[case]
            with pytest.raises(Exception) as refused:
                await engine.update_weights(state, version=9)
            assert await engine_greedy(engine) == before, f"{case}: the refused update changed the engine"
            assert isinstance(refused.value, EngineError), case
            assert said in str(refused.value) and "nothing was loaded" in str(refused.value), case
        await engine.update_weights(dict(new_state), version=9)  # the same weights, whole: they load
        return before, await engine_greedy(engine)

    try:
        before, after = asyncio.run(run())
    finally:
        engine.close()
    assert after[2] == 9 and after[1] != before[1]


def test_a_tied_tensor_may_come_once_and_stays_tied(tiny_dir, new_state):
    """save_pretrained leaves out lm_head.weight of a tied model: the embedding is loaded into both."""
    engine = HFEngine(load_model(tiny_dir), eos_token_ids=[], num_threads=1)
    asyncio.run(engine.update_weights(altered(new_state, lm_head__weight=None)))
    live = engine.model.state_dict()
    assert live["lm_head.weight"].data_ptr() == live["model.embed_tokens.weight"].data_ptr()
    assert torch.equal(live["lm_head.weight"], new_state["model.embed_tokens.weight"])
    engine.close()


def test_a_copy_that_fails_halfway_closes_the_engine_rather_than_serve_mixed_weights_simulated_fault(tiny_dir):
    """Checked weights cannot fail to copy on the CPU; a device error could (simulated by the load itself)."""
    engine = HFEngine(load_model(tiny_dir), eos_token_ids=[], num_threads=1)

    def half_a_copy():
        next(engine.model.parameters()).mul_(2.0)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(EngineError, match="part new, part old; restart it"):
        asyncio.run(engine._swap_weights(half_a_copy, None))
    assert engine.health() == "HFEngine is closed" and engine.get_version() == 0


@pytest.mark.slow
def test_a_process_engine_refuses_nan_weights_whole(tiny_dir, new_state):
    from areal_agents.engines.hf.process_engine import ProcessEngine

    engine = ProcessEngine(str(tiny_dir), options=EngineOptions(cpu_threads=1))

    async def run():
        before = await engine_greedy(engine)
        bad = altered(new_state, model__norm__weight=with_nan(new_state[NORM]))
        with pytest.raises(EngineError, match=f"EngineError: update_weights: '{NORM}' has NaN or infinite values"):
            await engine.update_weights(bad)
        assert await engine_greedy(engine) == before

    try:
        asyncio.run(run())
    finally:
        engine.close()


# ---- a broadcast (serve-model's /update_weights_from_distributed over gloo) --------------------------------


def join(url: str, name: str) -> object:
    """A weight group of this process (the trainer, rank 0) and the server at ``url`` (rank 1)."""
    port = free_port()
    joined = {}
    thread = threading.Thread(
        target=lambda: joined.update(
            group=join_group("127.0.0.1", port, rank=0, world_size=2, group_name=name, backend="gloo", timeout_s=60)
        )
    )
    thread.start()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "group_name": name}
    status, reply = call(url, "/init_weights_update_group", body)
    thread.join(60)
    assert status == 200 and reply["success"], reply
    return joined["group"]


def broadcast(url: str, group, state: dict, announced: dict | None = None) -> tuple[int, dict]:
    """One bucket of every tensor of ``state``: the POST on a thread while this process broadcasts."""
    announced = announced or {k: (str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in state.items()}
    body = {
        "names": list(announced),
        "dtypes": [d for d, _ in announced.values()],
        "shapes": [s for _, s in announced.values()],
        "group_name": group.name,
        "weight_version": "v-broadcast",
    }
    out = {}
    thread = threading.Thread(target=lambda: out.update(reply=call(url, "/update_weights_from_distributed", body)))
    thread.start()
    try:
        for t in state.values():
            group.broadcast(t.contiguous())
    except Exception as e:  # noqa: BLE001  (a refused announcement closes the server's end)
        out["broadcast_error"] = e
    thread.join(60)
    return out["reply"]


@pytest.mark.slow
def test_a_refused_broadcast_leaves_the_served_weights_and_version_as_they_were(served, new_state):
    url, _ = served
    before = greedy(url)

    group = join(url, "atomic-nan")
    bad = altered(new_state, model__norm__weight=with_nan(new_state[NORM]))
    status, reply = broadcast(url, group, bad)
    assert status == 400 and f"'{NORM}' has NaN or infinite values" in reply["message"], reply
    assert greedy(url) == before
    group.close()

    group = join(url, "atomic-shape")
    announced = {k: (str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in new_state.items()}
    announced[NORM] = ("float32", [10**9])  # refused before anything is allocated or received
    status, reply = broadcast(url, group, {}, announced)
    assert status == 400 and f"'{NORM}' has shape [1000000000], the served model's is [64]" in reply["message"]
    assert greedy(url) == before
    group.close()

    group = join(url, "atomic-good")  # the same tensors, finite: they load, under the version named
    status, reply = broadcast(url, group, new_state)
    group.close()
    assert status == 200 and reply["success"], reply
    assert greedy(url)[2] == "v-broadcast"


def test_a_broadcast_of_nan_weights_stops_before_any_server_is_paused(new_state):
    """The trainer's side: nothing to refuse reaches a server (here, none answers at all)."""

    class Source(HeldWeights):
        async def tensors(self):
            return altered(new_state, model__norm__weight=with_nan(new_state[NORM]))

    engine = SGLangEngine(["http://127.0.0.1:1"])
    sync = BroadcastSync([engine], dtype="bfloat16")
    with pytest.raises(EngineError, match=f"{NORM} have NaN or infinite values as sent; no server was touched"):
        asyncio.run(sync.push(Source()))
    assert engine.get_version() == 0
    asyncio.run(engine.aclose())
