"""`HFEngine` placement and precision (device, compute dtype) and in-process weight sharing with a trainer.

No GPU here: the CUDA choices are checked as `Placement` decisions over ``torch.device("cuda", 0)`` (no
tensor goes there), and the CUDA precision path (float32 weights shared with the trainer, bfloat16 steps
under autocast) runs for real on CPU, where torch's autocast does the same casts.
"""

import asyncio

import pytest
import torch
from test_hf_engine import forward_logprobs, prompt

from areal_agents.cli import build_parser
from areal_agents.engines import HFEngine
from areal_agents.engines.hf.engine_placement import Placement
from areal_agents.engines.hf.process_engine import ProcessEngine
from areal_agents.errors import ConfigError, EngineError
from areal_agents.models import load_model
from areal_agents.types import GenRequest, SamplingParams

CUDA = torch.device("cuda", 0)  # only named: Placement.of decides, nothing is allocated there


def generate(engine, ids, n=8):
    """Greedy ``n`` tokens of ``ids`` (no EOS stops it)."""
    return asyncio.run(engine.agenerate(GenRequest("r", ids, SamplingParams(max_new_tokens=n, temperature=0))))


def train_step(trainer, optimizer, ids):
    """One optimizer step of next-token cross-entropy on ``ids``: the trainer's weights change in place."""
    x = torch.tensor([ids])
    logits = trainer(x).logits[0, :-1]
    loss = torch.nn.functional.cross_entropy(logits, x[0, 1:])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_on_cpu_nothing_moves_and_nothing_is_cast(model):
    placement = Placement.of(model.dtype, "cpu")
    assert placement == Placement(torch.device("cpu"), torch.float32, torch.float32) and not placement.autocast
    pointers = [p.data_ptr() for p in model.parameters()]
    assert placement.place(model) is model and [p.data_ptr() for p in model.parameters()] == pointers
    assert Placement.of(torch.bfloat16, "cpu").dtype == torch.bfloat16  # a bf16 model stays bf16
    assert Placement.of(torch.float32, "auto", share_weights=True) == placement  # auto without a GPU: cpu


@pytest.mark.parametrize("device", [torch.device("cpu"), CUDA])
def test_compute_and_weights_dtype_by_device_and_sharing(device):
    """CUDA: a float32 model computes in bfloat16, its weights cast, or kept float32 under autocast when
    shared with the trainer; CPU: the model's dtype, unless asked. Explicit dtypes win on both."""
    on_gpu = device.type == "cuda"
    auto = Placement.of(torch.float32, device)
    assert auto.dtype == auto.weights_dtype == (torch.bfloat16 if on_gpu else torch.float32)
    shared = Placement.of(torch.float32, device, share_weights=True)
    assert (shared.dtype, shared.weights_dtype, shared.autocast) == (auto.dtype, torch.float32, on_gpu)
    assert Placement.of(torch.float32, device, "float32").dtype == torch.float32
    asked = Placement.of(torch.float32, device, "bfloat16", share_weights=True)
    assert (asked.dtype, asked.weights_dtype, asked.autocast) == (torch.bfloat16, torch.float32, True)
    assert Placement.of(torch.bfloat16, device).dtype == torch.bfloat16
    assert Placement.of(torch.float32, device, "float16").weights_dtype == torch.float16


def test_device_and_compute_dtype_are_checked(model):
    with pytest.raises(ConfigError, match="compute_dtype: expects one of auto, float32, bfloat16, float16, got 'fp8'"):
        HFEngine(model, compute_dtype="fp8")
    with pytest.raises(ConfigError, match="device: expects 'auto', 'cpu' or 'cuda', got 'gpu'"):
        HFEngine(model, device="gpu")


def test_a_bfloat16_engine_casts_its_weights_once_but_not_the_rotary_frequencies(model, tokenizer):
    engine = HFEngine(model, compute_dtype="bfloat16")
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16} and engine.kv_dtype == torch.bfloat16
    assert engine.model.model.rotary_emb.inv_freq.dtype == torch.float32  # as from_pretrained(dtype=bf16) has it
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # still tied
    ids = prompt(tokenizer)
    r = generate(engine, ids)
    ref = forward_logprobs(load_model(engine.model.config._name_or_path), ids + r.output_tokens, 8)  # float32
    assert torch.allclose(torch.tensor(r.output_logprobs), ref, atol=5e-2)
    engine.close()


def test_in_process_pushes_serve_the_trainers_own_tensors(tiny_dir, tokenizer):
    """After each push the engine's logprobs are a fresh forward's of the trainer's model (1e-4): the
    engine holds the trainer's storage itself, so an optimizer step is in it once the version is pushed,
    and the decode step's fused q/k/v and gate/up copies are made again."""
    trainer = load_model(tiny_dir)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    engine = HFEngine(load_model(tiny_dir), eos_token_ids=[], share_weights=True)
    assert engine._runner.decode_step is not None  # the fast step, whose fused weights are copies
    ids = prompt(tokenizer)
    before = torch.tensor(generate(engine, ids).output_logprobs)
    for version in (1, 2, 3):
        train_step(trainer, optimizer, ids + [5, 6, 7, 8])
        if version > 1:  # shared since the first push: the step is in the engine's tensors already
            assert torch.equal(engine.model.lm_head.weight, trainer.lm_head.weight)
        asyncio.run(engine.update_weights(trainer.state_dict(), version))
        engine_params = dict(engine.model.named_parameters())
        for name, p in trainer.named_parameters():
            assert engine_params[name].data_ptr() == p.data_ptr(), name  # no copy
            assert p.requires_grad and not engine_params[name].requires_grad  # the trainer's stay trainable
        r = generate(engine, ids)
        assert engine.get_version() == version and r.output_versions == [version] * 8
        ref = forward_logprobs(trainer, ids + r.output_tokens, 8)
        assert torch.allclose(torch.tensor(r.output_logprobs), ref, atol=1e-4)
        assert (ref - before).abs().max() > 1e-2  # the step moved them: old weights could not pass
        before = ref
    engine.close()


def test_a_trainer_step_after_a_push_stops_a_sharing_engine(tiny_dir, tokenizer):
    """Tokens from weights changed since the last push would carry a version they are not: refused, with
    the setting that avoids it named."""
    trainer = load_model(tiny_dir)
    optimizer = torch.optim.SGD(trainer.parameters(), lr=1e-2)
    engine = HFEngine(load_model(tiny_dir), share_weights=True)
    asyncio.run(engine.update_weights(trainer.state_dict()))
    ids = prompt(tokenizer)
    generate(engine, ids)  # pushed weights, untouched: fine
    train_step(trainer, optimizer, ids)
    with pytest.raises(EngineError, match=r"changed after version 1 was pushed.*rollout\.max_staleness=0"):
        generate(engine, ids)
    assert "rollout.max_staleness=0" in engine.health()
    engine.close()


def test_a_sharing_engine_refuses_other_dtypes_and_loading_from_disk(tiny_dir, tokenizer):
    engine = HFEngine(load_model(tiny_dir), share_weights=True)
    bf16 = {k: v.to(torch.bfloat16) for k, v in load_model(tiny_dir).state_dict().items()}
    with pytest.raises(
        EngineError, match=r"is torch\.bfloat16 on cpu, but this engine shares weights .* torch\.float32"
    ):
        asyncio.run(engine.update_weights(bf16))
    with pytest.raises(EngineError, match="would overwrite the trainer's"):
        asyncio.run(engine.update_weights_from_disk(str(tiny_dir)))
    assert engine.get_version() == 0 and len(generate(engine, prompt(tokenizer)).output_tokens) > 0  # still serves
    engine.close()


def test_shared_float32_weights_decode_under_bfloat16_autocast(tiny_dir, tokenizer):
    """The CUDA default for shared weights, run on CPU: float32 tensors (the trainer's), bfloat16 steps and
    KV cache, fused weights cast once a push; logprobs near the trainer's own autocast forward, next turns
    from the prefix cache included."""
    trainer = load_model(tiny_dir)
    engine = HFEngine(load_model(tiny_dir), eos_token_ids=[], share_weights=True, compute_dtype="bfloat16")
    asyncio.run(engine.update_weights(trainer.state_dict()))
    assert engine.kv_dtype == torch.bfloat16 and engine.model.dtype == torch.float32
    ids = prompt(tokenizer)
    first = generate(engine, ids)
    context = ids + first.output_tokens + prompt(tokenizer, "again")[1:]
    second = generate(engine, context)  # its first turn's KV from the prefix cache
    assert engine.stats.prefix_hit_tokens > 0
    assert engine._runner.decode_step._fused[0][1].qkv.dtype == torch.bfloat16
    full = forward_logprobs(trainer, ids + first.output_tokens, 8)  # float32: bfloat16 steps differ from it
    assert (torch.tensor(first.output_logprobs) - full).abs().max() > 1e-4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for start, r in ((ids, first), (context, second)):
            ref = forward_logprobs(trainer, start + r.output_tokens, 8)
            assert torch.allclose(torch.tensor(r.output_logprobs), ref, atol=3e-2)
    engine.close()


def test_process_engine_refuses_to_share_weights_across_processes(tiny_dir):
    with pytest.raises(ConfigError, match="set engine.own_process=false"):
        ProcessEngine(str(tiny_dir), share_weights=True)  # refused before any process starts


def test_serve_model_takes_a_device():
    parser = build_parser()
    assert parser.parse_args(["serve-model", "--model-path", "m"]).device == "cpu"
    assert parser.parse_args(["serve-model", "--model-path", "m", "--device", "cuda"]).device == "cuda"


def test_a_cancelled_request_left_in_the_batch_does_not_stop_a_sharing_engine(tiny_dir, tokenizer):
    """A synchronous run's trainer may step before the engine has dropped a cancelled request's row: that
    row is handed back without a decode step, and the engine serves the next push."""
    trainer = load_model(tiny_dir)
    optimizer = torch.optim.SGD(trainer.parameters(), lr=1e-2)
    engine = HFEngine(load_model(tiny_dir), eos_token_ids=[], share_weights=True)
    asyncio.run(engine.update_weights(trainer.state_dict()))
    ids = prompt(tokenizer)

    async def run():
        task = asyncio.ensure_future(engine.agenerate(GenRequest("long", ids, SamplingParams(max_new_tokens=400))))
        while engine.stats.decode_steps < 3:
            await asyncio.sleep(0.001)
        await engine.pause()  # its row stays in the batch
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # cancelled: its row is marked to go
        train_step(trainer, optimizer, ids)
        await engine.resume()
        # aborted is counted in the step, the row handed back after it
        while (engine.stats.aborted == 0 or engine.num_running) and engine.health() is None:
            await asyncio.sleep(0.001)

    asyncio.run(run())
    assert engine.health() is None and engine.num_running == 0
    asyncio.run(engine.update_weights(trainer.state_dict()))
    r = generate(engine, ids)
    assert torch.allclose(
        torch.tensor(r.output_logprobs), forward_logprobs(trainer, ids + r.output_tokens, 8), atol=1e-4
    )
    engine.close()
