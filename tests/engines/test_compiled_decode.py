"""`CompiledDecode` (``engine.compile_decode``): the decode step as compiled graphs gives transformers' greedy
tokens and a forward pass's logprobs, across row buckets and as rows come and go."""

import asyncio

import pytest
import torch
from test_llama_decode import PROMPTS, family_model, staggered
from torch._dynamo.utils import counters

from areal_agents.engines import HFEngine
from areal_agents.errors import ConfigError
from areal_agents.types import GenRequest, SamplingParams


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # biases; per-head q/k norms and grouped heads
def test_compiled_steps_give_generates_tokens_and_a_forward_passs_logprobs(family):
    reference = family_model(family)
    engine = HFEngine(family_model(family), eos_token_ids=[], compile_decode=True, seed=3)
    assert engine._runner.compiled is not None
    for p, r in zip(PROMPTS, staggered(engine, temperature=0)):
        ref = reference.generate(torch.tensor([p]), max_new_tokens=len(r.output_tokens), do_sample=False)
        assert r.output_tokens == ref[0, len(p) :].tolist()
    for p, r in zip(PROMPTS, staggered(engine, temperature=1.0)):
        with torch.no_grad():
            logits = reference(torch.tensor([p + r.output_tokens])).logits[0, len(p) - 1 : -1]
        expected = logits.log_softmax(-1).gather(1, torch.tensor(r.output_tokens)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(r.output_logprobs), expected, atol=1e-5)
    other = family_model(family, seed=1)  # new weights: the same graphs, the new fused weights as inputs
    asyncio.run(engine.update_weights(other.state_dict()))
    for p, r in zip(PROMPTS, staggered(engine, temperature=0)):
        ref = other.generate(torch.tensor([p]), max_new_tokens=len(r.output_tokens), do_sample=False)
        assert r.output_tokens == ref[0, len(p) :].tolist()
    assert engine._runner.compiled._broken is None  # compiled, not fallen back to eager
    engine.close()


@pytest.mark.slow
def test_rows_past_a_bucket_and_leaving_it_keep_their_tokens():
    """12 rows (the 16-row graph) that finish at different steps (down to the 8-row graph, padding rows
    included): each row's tokens are the eager engine's."""
    prompts = [[3 + i % 7] * (2 + 3 * i) + [7, 8] for i in range(12)]

    async def run(engine):
        return await asyncio.gather(
            *(
                engine.agenerate(GenRequest(str(i), p, SamplingParams(4 + i, temperature=0)))
                for i, p in enumerate(prompts)
            )
        )

    outputs = []
    for compile_decode in (False, True):
        engine = HFEngine(family_model("llama-gqa"), eos_token_ids=[], compile_decode=compile_decode)
        asyncio.run(engine.agenerate(GenRequest("first", [5, 6], SamplingParams(2))))  # after the compiles
        graphs = counters["stats"]["unique_graphs"]
        outputs.append([(r.output_tokens, r.output_logprobs) for r in asyncio.run(run(engine))])
        assert counters["stats"]["unique_graphs"] == graphs  # every step ran a graph compiled at the start
        engine.close()
    for (tokens, logprobs), (compiled_tokens, compiled_logprobs) in zip(*outputs):
        assert compiled_tokens == tokens
        assert torch.allclose(torch.tensor(compiled_logprobs), torch.tensor(logprobs), atol=1e-5)


def test_compile_decode_without_the_engines_own_step_names_the_setting():
    with pytest.raises(ConfigError, match="compile_decode: compiles fast_decode's step"):
        HFEngine(family_model("llama"), fast_decode=False, compile_decode=True)
