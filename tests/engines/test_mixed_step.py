"""Arrivals prefilled in the decode step's own pass over the weights (`BatchRunner.admit_decoding`)."""

import asyncio

import pytest
import torch

from areal_agents.engines import HFEngine
from areal_agents.types import GenRequest, SamplingParams
from tests.engines.test_hf_engine import forward_logprobs, prompt, run_multi_turn


def spy_on_mixed_passes(engine, fail_first=False):
    """Count the passes that decoded and prefilled at once; optionally make the first one fail."""
    step = engine._runner.decode_step
    real, calls = step.decode_and_prefill, []

    def decode_and_prefill(*args):
        calls.append(args[0].shape[0])  # rows decoding beside the prefill
        if fail_first and len(calls) == 1:
            raise RuntimeError("simulated fault in a mixed pass")
        return real(*args)

    step.decode_and_prefill = decode_and_prefill
    return calls


async def staggered(engine, prompts, lengths):
    """Greedy requests of ``lengths`` tokens: the first alone, the others once it has decoded a few tokens (they
    join a running batch)."""
    sampling = [SamplingParams(max_new_tokens=n, temperature=0) for n in lengths]
    first = asyncio.ensure_future(engine.agenerate(GenRequest("first", prompts[0], sampling[0])))
    while engine.stats.generated_tokens < 3:
        await asyncio.sleep(0.001)
    rest = [
        asyncio.ensure_future(engine.agenerate(GenRequest(str(i), p, s)))
        for i, (p, s) in enumerate(zip(prompts[1:], sampling[1:]))
    ]
    return [await first, *await asyncio.gather(*rest)]


def test_arrivals_prefilled_beside_a_decode_step_give_transformers_greedy_tokens(model, tokenizer):
    engine = HFEngine(model, eos_token_ids=[])
    calls = spy_on_mixed_passes(engine)
    prompts = [prompt(tokenizer, t) for t in ("1+2=", "34+56=", "345+6789=")]
    lengths = [400, 24, 24]  # the first still decodes when the others arrive
    replies = asyncio.run(staggered(engine, prompts, lengths))
    assert calls and calls[0] == 1, engine.stats  # the others were prefilled beside the first one's decode step
    for ids, reply, n in zip(prompts, replies, lengths):
        ref = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids) :].tolist()
        assert reply.output_tokens == ref
    engine.close()


@pytest.mark.parametrize("fail_first", [False, True], ids=["mixed", "a_failing_mixed_pass_simulated_fault"])
def test_next_turns_prefilled_beside_decode_steps_have_the_logprobs_of_a_forward_pass(model, tokenizer, fail_first):
    """Episodes a few ms apart: next turns (from the prefix cache) arrive while others decode. A mixed pass that
    fails is redone apart (the running rows one by one, the arrivals in a prefill of their own): nothing fails."""
    engine = HFEngine(model, eos_token_ids=[], seed=5)
    calls = spy_on_mixed_passes(engine, fail_first)
    episodes = run_multi_turn(engine, tokenizer, episodes=6, turns=3, new_tokens=lambda i, turn: 4 + (i + turn) % 5)
    assert len(calls) >= 3 and engine.stats.failed == 0 and engine.stats.prefix_hit_tokens > 0
    for turns in episodes:
        for context, reply in turns:
            n = len(reply.output_tokens)
            assert n == len(reply.output_logprobs) and reply.stop_reason == "length"
            expected = forward_logprobs(model, context + reply.output_tokens, n)
            assert torch.allclose(torch.tensor(reply.output_logprobs), expected, atol=1e-4)
    engine.close()
