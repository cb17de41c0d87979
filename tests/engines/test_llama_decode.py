"""`LlamaDecodeStep`: the engine's own decode step gives transformers' tokens and logprobs."""

import asyncio

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from areal_agents.engines import HFEngine
from areal_agents.engines.hf import decode_step
from areal_agents.engines.hf.decode_step import LlamaDecodeStep
from areal_agents.types import GenRequest, SamplingParams

TINY = dict(vocab_size=60, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig, dict(attention_bias=True, mlp_bias=True)),
    "llama-gqa": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=2)),
    "mistral": (MistralForCausalLM, MistralConfig, dict(num_key_value_heads=2, sliding_window=None)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(num_key_value_heads=2)),  # q/k/v biases
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(num_key_value_heads=2, head_dim=16)),  # per-head q/k norms
}
PROMPTS = [[3 + i] * (2 + 5 * i) + [7, 8] for i in range(5)]  # different lengths: segments of their own


def family_model(family, seed=0):
    cls, config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(config_cls(**{**TINY, **extra}, attn_implementation="sdpa"))
    with torch.no_grad():  # non-trivial norm weights and biases (initialised to 1 and 0)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def staggered(engine, temperature, new_tokens=9):
    """The prompts arriving 10 ms apart (each joins the running batch as a segment), all answered."""

    async def one(i):
        await asyncio.sleep(0.01 * i)
        sampling = SamplingParams(new_tokens + 2 * i, temperature=temperature)
        return await engine.agenerate(GenRequest(str(i), PROMPTS[i], sampling))

    async def run():
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    return asyncio.run(run())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_are_transformers_generate(family):
    engine = HFEngine(family_model(family), eos_token_ids=[])
    assert engine._runner.decode_step is not None
    reference = family_model(family)
    for p, r in zip(PROMPTS, staggered(engine, temperature=0)):
        ref = reference.generate(torch.tensor([p]), max_new_tokens=len(r.output_tokens), do_sample=False)
        assert r.output_tokens == ref[0, len(p) :].tolist()
    engine.close()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sampled_logprobs_are_those_of_a_transformers_forward_pass(family):
    """Sampled rows (no greedy path to hide behind) through this step and through transformers' forward
    (``fast_decode=False``): each token's logprob is a full forward pass's."""
    reference = family_model(family)
    for fast in (True, False):
        engine = HFEngine(family_model(family), eos_token_ids=[], seed=3, fast_decode=fast)
        assert (engine._runner.decode_step is not None) == fast
        for p, r in zip(PROMPTS, staggered(engine, temperature=1.0)):
            with torch.no_grad():
                logits = reference(torch.tensor([p + r.output_tokens])).logits[0, len(p) - 1 : -1]
            expected = logits.log_softmax(-1).gather(1, torch.tensor(r.output_tokens)[:, None]).squeeze(1)
            assert torch.allclose(torch.tensor(r.output_logprobs), expected, atol=1e-5)
        engine.close()


def test_weights_changed_in_place_are_used_at_the_next_step():
    """The fused q/k/v and gate/up copies follow the parameters: new weights loaded by `update_weights`,
    and a weight changed in place behind the engine's back."""
    model, reference = family_model("qwen2"), family_model("qwen2", seed=1)
    engine = HFEngine(model, eos_token_ids=[])
    staggered(engine, temperature=0)
    asyncio.run(engine.update_weights(reference.state_dict()))
    for p, r in zip(PROMPTS, staggered(engine, temperature=0)):
        ref = reference.generate(torch.tensor([p]), max_new_tokens=len(r.output_tokens), do_sample=False)
        assert r.output_tokens == ref[0, len(p) :].tolist()
    with torch.no_grad():
        for m in (model, reference):
            m.model.layers[1].self_attn.k_proj.weight.mul_(-3.0)
            m.model.layers[0].mlp.up_proj.weight.add_(0.5)
    for p, r in zip(PROMPTS, staggered(engine, temperature=0)):
        ref = reference.generate(torch.tensor([p]), max_new_tokens=len(r.output_tokens), do_sample=False)
        assert r.output_tokens == ref[0, len(p) :].tolist()
    engine.close()


def test_other_models_decode_through_transformers_forward():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4, attn_implementation="sdpa"))
    assert LlamaDecodeStep.of(gpt2) is None
    llama = family_model("llama")
    assert LlamaDecodeStep.of(llama) is not None
    del llama.model.layers[1].mlp.up_proj  # a layer of another shape under the llama model_type
    assert LlamaDecodeStep.of(llama) is None


def left_padded(contexts, start=None):
    """``contexts`` left-padded: input ids, attention mask, positions (after ``start[i]`` cached tokens)."""
    width, n = max(len(c) for c in contexts), len(contexts)
    ids, attention = torch.zeros((n, width), dtype=torch.long), torch.zeros((n, width), dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, width - len(c) :], attention[i, width - len(c) :] = torch.tensor(c), 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0) + torch.tensor(start or [0] * n)[:, None]
    return ids, attention, positions


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("budget", [1024, 6])  # one chunk; rows in chunks, long rows alone a span at a time
def test_prefill_is_a_transformers_forward_pass(family, budget, monkeypatch):
    """The step's own prefill, from scratch and after cached keys and values: each row's next-token logits and
    its real columns' keys and values are transformers' (left padding, rows of 4 to 24 tokens)."""
    monkeypatch.setattr(decode_step, "PREFILL_TOKENS", budget)
    monkeypatch.setattr(decode_step, "PREFILL_CELLS", budget)
    model = family_model(family)
    step = LlamaDecodeStep.of(model)
    with torch.no_grad():
        ids, attention, positions = left_padded(PROMPTS)
        logits, kv = step.prefill(ids, positions, attention)
        ref = model(ids, attention_mask=attention, position_ids=positions, use_cache=True)
        assert torch.allclose(logits, ref.logits[:, -1].float(), atol=1e-5)
        real = attention.bool()
        for (k, v), layer in zip(kv, ref.past_key_values.layers):
            assert torch.allclose(k.transpose(1, 2)[real], layer.keys.transpose(1, 2)[real], atol=1e-5)
            assert torch.allclose(v.transpose(1, 2)[real], layer.values.transpose(1, 2)[real], atol=1e-5)

        cut = [len(p) // 2 for p in PROMPTS]  # the first halves cached, the second halves prefilled after them
        past_ids, past_attention, past_positions = left_padded([p[:c] for p, c in zip(PROMPTS, cut)])
        past = model(past_ids, attention_mask=past_attention, position_ids=past_positions, use_cache=True)
        cached = [(layer.keys, layer.values) for layer in past.past_key_values.layers]
        ids, attention, positions = left_padded([p[c:] for p, c in zip(PROMPTS, cut)], start=cut)
        logits, _ = step.prefill(ids, positions, torch.cat([past_attention, attention], 1), cached)
        whole = [model(torch.tensor([p])).logits[0, -1] for p in PROMPTS]
        assert torch.allclose(logits, torch.stack(whole).float(), atol=1e-5)


def test_prefill_chunks_hold_rows_of_like_length_and_passes_share_the_products():
    """Rows longest first; a chunk's rows at least LIKE_LENGTH of its longest (so its padding stays small); chunks
    of few rows run together in one pass of at most the budget's tokens; a row longer than the budget, in spans."""
    from areal_agents.engines.hf.decode_step import _passes, _prefill_chunks

    lengths = [10, 24, 4, 23, 9, 40]
    chunks = _prefill_chunks(lengths, 40, 32, torch.device("cpu"))
    assert [(idx.tolist(), span) for idx, span in chunks] == [
        ([5], (0, 32)),  # 40 tokens > 32: spans of the row alone
        ([5], (32, 40)),
        ([1], (16, 40)),  # 24 and 23 are alike, but two rows of 24 exceed the budget
        ([3], (17, 40)),
        ([0, 4], (30, 40)),  # 10 and 9
        ([2], (36, 40)),  # 4 < 0.8 x 10
    ]
    assert [[len(idx) * (c1 - c0) for idx, (c0, c1) in p] for p in _passes(chunks, 32)] == [
        [32],
        [8, 24],
        [23],
        [20, 4],
    ]
