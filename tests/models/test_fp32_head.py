"""The float32 LM head (`fp32_head`): the trainer's token logprobs and the engine's behavior logprobs of a
bfloat16 model against a float64 reference computed by hand from the same hidden states and head weight,
and the vocabulary-chunked backward against an unchunked float64 one."""

import asyncio
import contextlib

import pytest
import torch

from areal_agents.engines import HFEngine
from areal_agents.engines.hf import decode_step
from areal_agents.models import load_model
from areal_agents.models.fp32_head import head_token_logprobs, linear_head
from areal_agents.models.logprobs import chunked_token_logprobs, tempered_token_logprobs
from areal_agents.trainers.batching import hidden_states, make_micro_batches, token_logprobs
from areal_agents.types import GenRequest, SamplingParams, Trajectory

T = 0.8  # a sampling temperature other than 1, so that the scaling is checked too


def _reference(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log softmax(h W^T / T)`` at ``tokens``, all in float64: the exact value of the head's inputs."""
    logits = hidden.double() @ weight.double().T / temperature
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)


def _bf16_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, tokens: torch.Tensor, temperature: float):
    """What the trainer and the engine computed before: bfloat16 logits, an fp32 log-softmax of them."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return tempered_token_logprobs(head(hidden), tokens, temperature)


def _trajectories() -> list[Trajectory]:
    rows = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 30, 31, 32], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    return [Trajectory(ids, [0, 0] + [1] * (len(ids) - 2), [0.0] * len(ids), [-1] * len(ids), 0.0) for ids in rows]


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("weights", ["bfloat16", "float32 under bfloat16 autocast"])
def test_trainer_logprobs_of_a_bfloat16_model_are_float32_exact(tiny_dir, pack, weights):
    """bfloat16 weights (FSDP2's param_dtype) or float32 weights under autocast (the unsharded trainer): the
    same hidden states scored by hand in float64 agree to float32 rounding; bfloat16 logits are far off."""
    model = load_model(tiny_dir, "bfloat16" if weights == "bfloat16" else "float32")
    precision = torch.autocast("cpu", dtype=torch.bfloat16) if weights != "bfloat16" else contextlib.nullcontext()
    (mb,) = make_micro_batches(_trajectories(), 4096, pack=pack)
    with torch.no_grad(), precision:
        logp = token_logprobs(model, mb, T)[:, 1:]
        hidden = hidden_states(model.get_decoder(), mb)[:, :-1]  # deterministic: the hidden states scored above
        old = _bf16_logprobs(hidden, model.get_output_embeddings(), mb.input_ids[:, 1:], T)
    assert hidden.dtype == (torch.bfloat16 if weights == "bfloat16" else torch.float32)  # autocast: norm's fp32 weight
    ref = _reference(hidden, model.get_output_embeddings().weight, mb.input_ids[:, 1:], T)
    scored = logp != 0  # packed: a trajectory's first token is 0, not scored
    err, err_bf16 = (logp - ref)[scored].abs().max().item(), (old - ref)[scored].abs().max().item()
    assert logp.dtype == torch.float32 and err < 2e-6
    assert err_bf16 > 20 * err  # bfloat16 logits: about 1e-3 off here; float32: about 1e-7


@pytest.mark.parametrize("fast_decode", [True, False])
@pytest.mark.parametrize("weights", ["bfloat16", "float32 under bfloat16 autocast"])
def test_engine_behavior_logprobs_of_a_bfloat16_model_are_float32_exact(tiny_dir, monkeypatch, fast_decode, weights):
    """Every hidden state the engine's head saw (prefill and decode steps) is kept; each sampled token's
    behavior logprob is its float64 value to float32 rounding, where bfloat16 logits were far off."""
    seen = []
    float32_logits = decode_step.float32_logits

    def spy(hidden, head):
        seen.append(hidden.clone())
        return float32_logits(hidden, head)

    monkeypatch.setattr(decode_step, "float32_logits", spy)
    model = load_model(tiny_dir, "bfloat16" if weights == "bfloat16" else "float32")
    shared = {} if weights == "bfloat16" else {"compute_dtype": "bfloat16", "share_weights": True}
    engine = HFEngine(model, eos_token_ids=[], seed=4, fast_decode=fast_decode, **shared)
    request = GenRequest("r", [5, 6, 7, 8], SamplingParams(max_new_tokens=6, temperature=T))
    response = asyncio.run(engine.agenerate(request))
    assert len(seen) == 6 and all(h.shape[0] == 1 for h in seen)  # one row: call k sampled token k
    hidden, tokens = torch.cat(seen), torch.tensor(response.output_tokens)
    assert hidden.dtype == (torch.bfloat16 if weights == "bfloat16" else torch.float32)  # autocast: norm's fp32 weight
    ref = _reference(hidden, model.lm_head.weight, tokens, T)
    err = (torch.tensor(response.output_logprobs, dtype=torch.float64) - ref).abs().max().item()
    err_bf16 = (_bf16_logprobs(hidden, model.lm_head, tokens, T) - ref).abs().max().item()
    assert err < 2e-6 and err_bf16 > 20 * err


def test_vocabulary_chunks_that_do_not_divide_it_give_the_float64_values():
    """V = 11 in chunks of 4 (4 + 4 + 3); targets on each chunk's first and last column."""
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(8, 5, generator=gen), torch.randn(11, 5, generator=gen)
    tokens = torch.tensor([0, 3, 4, 7, 8, 10, 10, 5])
    ref = _reference(hidden, weight, tokens, T)
    for chunk in (1, 4, 11, 64):
        out = head_token_logprobs(hidden, weight, None, tokens, T, chunk_vocab=chunk)
        assert out.dtype == torch.float32 and torch.allclose(out.double(), ref, atol=2e-6), chunk


def test_the_chunked_backward_passes_a_float64_gradient_check():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=gen, requires_grad=True)
    tokens = torch.tensor([0, 3, 4, 10, 7, 8])
    assert torch.autograd.gradcheck(lambda h, w, b: head_token_logprobs(h, w, b, tokens, T, 4), (hidden, weight, bias))


def test_chunked_gradients_in_float32_match_an_unchunked_float64_reference():
    """Token chunks of 3 and vocabulary chunks of 4 over 10 tokens and 11 columns: value, and gradients of
    the hidden states, the weight and the bias, against one float64 pass."""
    gen = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(5, 11)
    hidden = torch.randn(10, 5, generator=gen, requires_grad=True)
    tokens = torch.randint(0, 11, (10,), generator=gen)
    upstream = torch.randn(10, generator=gen)
    out = chunked_token_logprobs(hidden, head, tokens, T, chunk_tokens=3, chunk_vocab=4)
    grads = torch.autograd.grad((out * upstream).sum(), (hidden, head.weight, head.bias))
    leaves = [t.detach().double().requires_grad_() for t in (hidden, head.weight, head.bias)]
    logits = (leaves[0] @ leaves[1].T + leaves[2]) / T
    ref = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    ref_grads = torch.autograd.grad((ref * upstream.double()).sum(), leaves)
    assert torch.allclose(out.double(), ref, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.float32 and torch.allclose(g.double(), r, atol=1e-5)


def test_a_bfloat16_weight_gets_a_bfloat16_gradient_of_float32_sums():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(11, 5, generator=gen).bfloat16().requires_grad_()
    hidden = torch.randn(6, 5, generator=gen).bfloat16().requires_grad_()
    tokens = torch.tensor([0, 3, 4, 10, 7, 8])
    out = head_token_logprobs(hidden, weight, None, tokens, T, chunk_vocab=4)
    g_hidden, g_weight = torch.autograd.grad(out.sum(), (hidden, weight))
    assert (g_hidden.dtype, g_weight.dtype) == (torch.bfloat16, torch.bfloat16)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    r_hidden, r_weight = torch.autograd.grad(_reference(h64, w64, tokens, T).sum(), (h64, w64))
    # exact to the one final rounding to bfloat16 (8 significant bits)
    assert torch.allclose(g_hidden.double(), r_hidden, rtol=8e-3, atol=1e-6)
    assert torch.allclose(g_weight.double(), r_weight, rtol=8e-3, atol=1e-6)


def test_a_head_that_is_not_a_plain_linear_runs_its_own_forward():
    """A hooked head (a LoRA on it, a separately sharded head) is not bypassed: its hook still acts."""
    head = torch.nn.Linear(5, 11)
    assert linear_head(head) == (head.weight, head.bias)
    head.register_forward_hook(lambda module, args, out: out + torch.arange(11.0))
    assert linear_head(head) is None
    hidden, tokens = torch.randn(4, 5), torch.tensor([0, 1, 9, 10])
    with torch.no_grad():
        out = chunked_token_logprobs(hidden, head, tokens, T, chunk_tokens=3, chunk_vocab=4)
        assert torch.allclose(out, tempered_token_logprobs(head(hidden), tokens, T))


@pytest.mark.process
def test_fsdp2_bfloat16_params_score_float32_exact_and_train_the_head(tiny_dir, tmp_path, monkeypatch):
    """One gloo rank, FSDP2 with bfloat16 param_dtype (the sharded `ScoredLM` path): the head's weight arrives
    all-gathered in bfloat16 and its logprobs are float64's to float32 rounding; the sharded head gets a
    float32 gradient."""
    from torch import distributed as dist

    from areal_agents.models import fp32_head
    from areal_agents.trainers.fsdp import shard_policy

    seen = {}
    forward = fp32_head._HeadLogprobs.forward

    def spy(ctx, hidden, weight, *args):
        seen["hidden"], seen["weight"] = hidden.detach().clone(), weight.detach().clone()
        return forward(ctx, hidden, weight, *args)

    monkeypatch.setattr(fp32_head._HeadLogprobs, "forward", staticmethod(spy))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        scored, _, _ = shard_policy(load_model(tiny_dir), None, None, torch.device("cpu"), torch.bfloat16)
        (mb,) = make_micro_batches(_trajectories(), 4096, pack=True)
        logp = token_logprobs(scored, mb, T)
        logp.sum().backward()
        grad = scored.lm.lm_head.weight.grad.full_tensor()
    finally:
        dist.destroy_process_group()
    assert seen["hidden"].dtype == seen["weight"].dtype == torch.bfloat16
    ref = _reference(seen["hidden"], seen["weight"], mb.input_ids[0, 1:], T)
    scored_tokens = logp[0, 1:] != 0
    assert (logp[0, 1:] - ref)[scored_tokens].abs().max() < 2e-6
    assert grad.dtype == torch.float32 and grad.abs().sum() > 0
