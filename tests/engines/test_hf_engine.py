import asyncio

import pytest
import torch

from areal_agents.engines import HFEngine, InferenceEngine
from areal_agents.errors import EngineError
from areal_agents.types import GenRequest, SamplingParams


def prompt(tokenizer, text="12+34="):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )


def forward_logprobs(model, ids, n_out, temperature=1.0):
    """Logprobs of the last n_out tokens of ids by a fresh full forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return logp[-n_out:]


def run_multi_turn(engine, tokenizer, episodes, turns, new_tokens):
    """Episodes whose next request is the context + output + a reply, started 3 ms apart (merges leave
    holes in the rows); ``new_tokens(i, turn)`` tokens a turn. [(context, response)] per episode."""
    reply = prompt(tokenizer, "wrong, again:")[1:]

    async def episode(i):
        await asyncio.sleep(0.003 * i)
        context, out = prompt(tokenizer, f"{i}+{i * 13}="), []
        for turn in range(turns):
            r = await engine.agenerate(GenRequest(f"{i}.{turn}", context, SamplingParams(new_tokens(i, turn))))
            out.append((list(context), r))
            context = context + r.output_tokens + reply
        return out

    async def run():
        return await asyncio.gather(*(episode(i) for i in range(episodes)))

    return asyncio.run(run())


def perturbed(tiny_dir):
    """The tiny model with noise on every weight: "new weights" for an update."""
    from areal_agents.models import load_model

    model = load_model(tiny_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_is_an_inference_engine(model):
    assert isinstance(HFEngine(model), InferenceEngine)


def test_greedy_matches_transformers_generate(model, tokenizer):
    ids = prompt(tokenizer)
    engine = HFEngine(model)
    resp = asyncio.run(engine.agenerate(GenRequest("r", ids, SamplingParams(max_new_tokens=12, temperature=0))))
    ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
    assert resp.output_tokens == ref
    assert resp.stop_reason == ("stop" if ref[-1] == tokenizer.eos_token_id else "length")


def test_batched_sampling_logprobs_match_a_forward_pass(model, tokenizer):
    engine = HFEngine(model, seed=1)
    prompts = [prompt(tokenizer, t) for t in ("1+2=", "34+56=", "7+800=")]  # different lengths: padding

    async def run():
        reqs = [
            GenRequest(str(i), p, SamplingParams(max_new_tokens=10, temperature=0.7)) for i, p in enumerate(prompts)
        ]
        return await asyncio.gather(*[engine.agenerate(r) for r in reqs])

    responses = asyncio.run(run())
    assert engine.stats.max_running == 3  # decoded together (later arrivals merged into the running batch)
    for p, r in zip(prompts, responses):
        ref = forward_logprobs(model, p + r.output_tokens, len(r.output_tokens), temperature=0.7)
        assert torch.allclose(torch.tensor(r.output_logprobs), ref, atol=1e-4)
        assert r.output_versions == [0] * len(r.output_tokens)


def test_a_group_of_identical_prompts_is_prefilled_once(model, tokenizer):
    engine = HFEngine(model, seed=3)
    group = [prompt(tokenizer, "12+34=")] * 8 + [prompt(tokenizer, "5+6=")] * 4

    async def run():
        await engine.pause()  # so that all twelve are admitted in one step
        reqs = [GenRequest(str(i), p, SamplingParams(max_new_tokens=10, temperature=1.0)) for i, p in enumerate(group)]
        tasks = [asyncio.create_task(engine.agenerate(r)) for r in reqs]
        await asyncio.sleep(0.05)
        await engine.resume()
        return await asyncio.gather(*tasks)

    responses = asyncio.run(run())
    assert engine.stats.prefills == 1 and engine.stats.max_running == 12  # admitted together
    assert engine.stats.prefill_tokens == len(group[0]) + len(group[-1])  # 2 distinct contexts
    assert len({tuple(r.output_tokens) for r in responses[:8]}) > 1  # rows sample independently
    for p, r in zip(group, responses):
        ref = forward_logprobs(model, p + r.output_tokens, len(r.output_tokens))
        assert torch.allclose(torch.tensor(r.output_logprobs), ref, atol=1e-4)


def test_counters_through_the_engine_protocol_are_the_stats_as_floats(model, tokenizer):
    """`InferenceEngine.counters` reads an engine's counters without naming it: HFEngine's are its `EngineStats`,
    cumulative (a second request adds to them); an engine that keeps none gives the protocol's default, none."""
    from dataclasses import asdict

    engine = HFEngine(model)
    request = GenRequest("r", prompt(tokenizer), SamplingParams(5, temperature=0, ignore_eos=True))
    first = asyncio.run(engine.counters())
    assert first == dict.fromkeys(asdict(engine.stats), 0.0)
    first_reply = asyncio.run(engine.agenerate(request))
    once = asyncio.run(engine.counters())
    assert all(isinstance(v, float) for v in once.values()) and once == {
        k: float(v) for k, v in asdict(engine.stats).items()
    }
    # 5 tokens: the prefill samples the first, 4 decode steps the rest
    assert once["generated_tokens"] == 5.0 and once["decode_steps"] == 4.0 and once["busy_seconds"] > 0
    assert once["prefill_tokens"] == len(request.input_ids) and once["prefix_hit_tokens"] == 0.0
    next_turn = request.input_ids + first_reply.output_tokens + request.input_ids[-2:]
    asyncio.run(engine.agenerate(GenRequest("r2", next_turn, request.sampling)))
    twice = asyncio.run(engine.counters())
    assert twice["generated_tokens"] == 10.0 and twice["requests"] == 2.0
    # the next turn's context: the first one's (prompt + its tokens but the last) came from the prefix cache
    assert twice["prefix_hit_tokens"] == len(request.input_ids) + 4
    assert twice["prefill_tokens"] == once["prefill_tokens"] + 3
    assert asyncio.run(type("Counterless", (InferenceEngine,), {})().counters()) == {}
    engine.close()


def test_weight_update_mid_generation_resumes_with_new_version(model, tokenizer, tiny_dir):

    engine = HFEngine(model, eos_token_ids=[], seed=0)  # no EOS: every request runs its full length
    new_weights = perturbed(tiny_dir)
    n_tokens = 120
    prompts = [prompt(tokenizer, f"{i}+{i}=") for i in range(6)]

    async def run():
        tasks = [
            asyncio.ensure_future(engine.agenerate(GenRequest(str(i), p, SamplingParams(max_new_tokens=n_tokens))))
            for i, p in enumerate(prompts)
        ]
        while engine.stats.decode_steps < 20:  # let the batch decode some tokens
            await asyncio.sleep(0.001)
        await engine.update_weights(new_weights.state_dict())
        return await asyncio.gather(*tasks)

    responses = asyncio.run(run())
    assert engine.get_version() == 1
    assert engine.stats.weight_updates == 1 and engine.stats.aborted == 0  # continued in place, re-prefilled
    for p, r in zip(prompts, responses):
        assert len(r.output_tokens) == n_tokens and r.stop_reason == "length"  # complete, nothing lost
        v = r.output_versions
        assert v == sorted(v) and v[0] == 0 and v[-1] == 1  # switches exactly once, at the update
        switch = v.index(1)
        assert 0 < switch < n_tokens
        after = forward_logprobs(new_weights, p + r.output_tokens, n_tokens - switch)
        assert torch.allclose(torch.tensor(r.output_logprobs[switch:]), after, atol=1e-4)
        before = forward_logprobs(model.__class__.from_pretrained(tiny_dir), p + r.output_tokens[:switch], switch)
        assert torch.allclose(torch.tensor(r.output_logprobs[:switch]), before, atol=1e-4)


def test_finished_rows_left_in_the_cache_stay_finished(model, tokenizer, tiny_dir):
    """One row of seventeen finishes early and stays in the KV cache (under a sixteenth of the batch) while the
    rest decode on through a weight update: its response is final at once, nothing is added to it, the
    update re-prefills only the live rows, and every live row continues exactly."""

    engine = HFEngine(model, eos_token_ids=[], seed=0)
    new_weights = perturbed(tiny_dir)
    prompts = [prompt(tokenizer, f"{i}+{i}=") for i in range(17)]
    lengths = [4] + [60] * 16

    async def run():
        await engine.pause()  # admitted together
        tasks = [
            asyncio.ensure_future(engine.agenerate(GenRequest(str(i), p, SamplingParams(max_new_tokens=n))))
            for i, (p, n) in enumerate(zip(prompts, lengths))
        ]
        await asyncio.sleep(0.02)
        await engine.resume()
        short = await tasks[0]
        tokens_then = list(short.output_tokens)
        while engine.stats.decode_steps < 15:
            await asyncio.sleep(0.001)
        await engine.update_weights(new_weights.state_dict())
        return short, tokens_then, await asyncio.gather(*tasks[1:])

    short, tokens_then, responses = asyncio.run(run())
    assert len(short.output_tokens) == 4 and short.output_tokens == tokens_then and short.output_versions == [0] * 4
    ref = forward_logprobs(model.__class__.from_pretrained(tiny_dir), prompts[0] + short.output_tokens, 4)
    assert torch.allclose(torch.tensor(short.output_logprobs), ref, atol=1e-4)
    assert engine.stats.generated_tokens == sum(lengths)  # the finished row's extra decoding counted nowhere
    for p, r in zip(prompts[1:], responses):
        v = r.output_versions
        assert len(r.output_tokens) == 60 and v == sorted(v) and v[0] == 0 and v[-1] == 1
        switch = v.index(1)
        after = forward_logprobs(new_weights, p + r.output_tokens, 60 - switch)
        assert torch.allclose(torch.tensor(r.output_logprobs[switch:]), after, atol=1e-4)


def test_paused_engine_waits_for_resume(model, tokenizer):
    engine = HFEngine(model)

    async def run():
        await engine.pause()
        task = asyncio.ensure_future(engine.agenerate(GenRequest("r", prompt(tokenizer), SamplingParams(4))))
        await asyncio.sleep(0.05)
        assert not task.done()
        await engine.resume()
        return await task

    assert len(asyncio.run(run()).output_tokens) >= 1


def test_continuous_batching_staggered_requests_match_unbatched(model, tokenizer):
    """Requests arrive while others decode, with different lengths and sampling; each is exact."""
    engine = HFEngine(model, eos_token_ids=[], seed=3)
    specs = [(f"{i}*{i + 7}=", 3 + (i * 7) % 25, 0.0 if i % 2 else 0.8) for i in range(12)]

    async def one(i, text, n, temperature):
        await asyncio.sleep(0.004 * i)  # staggered: most arrive mid-decode
        return await engine.agenerate(GenRequest(str(i), prompt(tokenizer, text), SamplingParams(n, temperature)))

    async def run():
        return await asyncio.gather(*(one(i, *spec) for i, spec in enumerate(specs)))

    responses = asyncio.run(run())
    assert engine.stats.prefills > 1 and engine.stats.max_running > 1  # joined a running batch
    for (text, n, temperature), r in zip(specs, responses):
        ids = prompt(tokenizer, text)
        assert len(r.output_tokens) == n and r.stop_reason == "length"
        if temperature == 0:
            ref = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None)
            assert r.output_tokens == ref[0, len(ids) :].tolist()
        else:
            ref = forward_logprobs(model, ids + r.output_tokens, n, temperature=temperature)
            assert torch.allclose(torch.tensor(r.output_logprobs), ref, atol=1e-4)


def test_abort_returns_partial_tokens_and_agenerate_completes_anyway(model, tokenizer):
    engine = HFEngine(model, eos_token_ids=[])

    async def run():
        request = GenRequest("a", prompt(tokenizer), SamplingParams(200))
        once = asyncio.ensure_future(engine.generate_once(request))
        full = asyncio.ensure_future(engine.agenerate(GenRequest("b", prompt(tokenizer), SamplingParams(60))))
        while engine.stats.decode_steps < 10:
            await asyncio.sleep(0.001)
        assert await engine.abort("a") == 1
        partial = await once
        await engine.abort()  # everything: "b" is resubmitted by agenerate and still completes
        return partial, await full

    partial, full = asyncio.run(run())
    assert partial.stop_reason == "abort" and 0 < len(partial.output_tokens) < 200
    assert full.stop_reason == "length" and len(full.output_tokens) == 60
    assert engine.stats.aborted == 2 and engine.num_running == 0


def test_update_weights_from_disk(model, tokenizer, tiny_dir, tmp_path):
    from areal_agents.models import load_model

    changed = load_model(tiny_dir)
    with torch.no_grad():
        for p in changed.parameters():
            p.mul_(1.5)
    changed.save_pretrained(tmp_path / "new")
    engine = HFEngine(load_model(tiny_dir))
    ids = prompt(tokenizer)

    async def run():
        await engine.update_weights_from_disk(str(tmp_path / "new"), version=7)
        return await engine.agenerate(GenRequest("r", ids, SamplingParams(5, temperature=0)))

    r = asyncio.run(run())
    ref = changed.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)[0, len(ids) :].tolist()
    assert r.output_tokens == ref[: len(r.output_tokens)] and r.output_versions == [7] * len(r.output_tokens)
    with pytest.raises(EngineError, match="no \\*.safetensors"):
        asyncio.run(engine.update_weights_from_disk(str(tmp_path)))


def test_next_turns_reuse_the_cache_of_the_previous_turn(model, tokenizer):
    """Multi-turn episodes: each next request is the previous context + output + a reply. Only the new
    tokens are prefilled, the rest comes from the prefix cache, and every logprob equals a full forward
    pass, while other episodes join and leave the running batch (cache rows with padding holes)."""
    engine = HFEngine(model, eos_token_ids=[], seed=5)
    episodes = run_multi_turn(engine, tokenizer, 8, 3, lambda i, turn: 3 + (i + turn) % 5)
    contexts = sum(len(ctx) for turns in episodes for ctx, _ in turns)
    assert engine.stats.prefix_hit_tokens > contexts / 2  # the later turns came from the cache
    assert engine.stats.prefill_tokens + engine.stats.prefix_hit_tokens == contexts
    for turns in episodes:
        for ctx, r in turns:
            ref = forward_logprobs(model, ctx + r.output_tokens, len(r.output_tokens))
            assert torch.allclose(torch.tensor(r.output_logprobs), ref, atol=1e-4)


def test_new_weights_empty_the_prefix_cache(model, tokenizer, tiny_dir):

    engine = HFEngine(model, eos_token_ids=[], seed=0)
    new_weights = perturbed(tiny_dir)
    first = prompt(tokenizer, "3+4=")

    async def run():
        r = await engine.agenerate(GenRequest("a", first, SamplingParams(4)))
        await engine.update_weights(new_weights.state_dict())
        second = first + r.output_tokens + first[1:]
        return second, await engine.agenerate(GenRequest("b", second, SamplingParams(4)))

    second, r = asyncio.run(run())
    assert engine.stats.prefix_hit_tokens == 0 and engine.stats.prefill_tokens == len(first) + len(second)
    ref = forward_logprobs(new_weights, second + r.output_tokens, 4)  # the old weights' keys were not reused
    assert torch.allclose(torch.tensor(r.output_logprobs), ref, atol=1e-4)


def test_flush_cache_forgets_the_cached_prefixes(model, tokenizer):
    engine = HFEngine(model, eos_token_ids=[], seed=0)
    first = prompt(tokenizer, "3+4=")

    async def run(flush):
        r = await engine.agenerate(GenRequest("a", first, SamplingParams(4)))
        if flush:
            engine.flush_cache()
        await engine.agenerate(GenRequest("b", first + r.output_tokens + first[1:], SamplingParams(4)))
        return engine.stats.prefix_hit_tokens

    assert asyncio.run(run(flush=False)) == len(first) + 3  # the first request's context and 3 of its tokens
    assert asyncio.run(run(flush=True)) == len(first) + 3  # nothing more taken from the cache


def test_a_group_resumed_after_a_weight_swap_runs_its_prompt_once(model, tokenizer, tiny_dir):
    """After new weights, the rows of one group re-run prompt + own tokens: the shared prompt runs once
    (through the prefix cache) and every token after the swap is still exact under the new weights."""

    engine = HFEngine(model, eos_token_ids=[], seed=0)
    new_weights = perturbed(tiny_dir)
    ids, n_tokens = prompt(tokenizer, "12+34="), 40

    async def run():
        tasks = [
            asyncio.ensure_future(engine.agenerate(GenRequest(str(i), ids, SamplingParams(n_tokens)))) for i in range(6)
        ]
        while engine.stats.decode_steps < 10:
            await asyncio.sleep(0.001)
        before = engine.stats.prefill_tokens
        await engine.update_weights(new_weights.state_dict())
        responses = await asyncio.gather(*tasks)
        return responses, engine.stats.prefill_tokens - before

    responses, rerun = asyncio.run(run())
    switches = [r.output_versions.index(1) for r in responses]
    assert len({tuple(r.output_tokens) for r in responses}) > 1  # sampled apart: six distinct contexts
    assert rerun == len(ids) + sum(switches)  # the prompt once (not six times), then each row's own tokens
    assert engine.stats.prefix_hit_tokens >= 5 * len(ids)
    for r, switch in zip(responses, switches):
        after = forward_logprobs(new_weights, ids + r.output_tokens, n_tokens - switch)
        assert torch.allclose(torch.tensor(r.output_logprobs[switch:]), after, atol=1e-4)


def test_keeping_the_stale_kv_continues_without_re_prefill_and_logs_the_true_behavior(model, tokenizer, tiny_dir):
    """stale_kv="keep" (in-flight weight update): tokens after the swap come from the new weights over the
    old weights' cache, and their logprobs are exactly that distribution's; cached prefixes survive."""
    from areal_agents.models import load_model

    old = load_model(tiny_dir)
    engine = HFEngine(model, eos_token_ids=[], seed=0, stale_kv="keep")
    new_weights = perturbed(tiny_dir)
    ids, n = prompt(tokenizer), 60

    async def run():
        first = await engine.agenerate(GenRequest("t0", ids, SamplingParams(3)))
        task = asyncio.ensure_future(engine.agenerate(GenRequest("r", ids, SamplingParams(n))))
        while engine.stats.decode_steps < 10:
            await asyncio.sleep(0.001)
        prefilled = engine.stats.prefill_tokens
        await engine.update_weights(new_weights.state_dict())
        r = await task
        assert engine.stats.prefill_tokens == prefilled  # nothing ran again
        hits = engine.stats.prefix_hit_tokens
        await engine.agenerate(GenRequest("t1", ids + first.output_tokens + ids[-3:], SamplingParams(2)))
        assert engine.stats.prefix_hit_tokens > hits  # the old turn's cache is still used
        return r

    r = asyncio.run(run())
    switch = r.output_versions.index(1)
    assert 0 < switch < n and r.output_versions[switch:] == [1] * (n - switch)
    with torch.no_grad():  # old weights' cache up to the token sampled last before the swap, new weights after
        cache = old(torch.tensor([ids + r.output_tokens[: switch - 1]]), use_cache=True).cache
        logits = new_weights(torch.tensor([r.output_tokens[switch - 1 :]]), cache=cache, use_cache=True).logits[0, :-1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(r.output_tokens[switch:])[:, None])
    assert torch.allclose(torch.tensor(r.output_logprobs[switch:]), expected.squeeze(1), atol=1e-4)
    fresh = forward_logprobs(new_weights, ids + r.output_tokens, n - switch)
    assert not torch.allclose(torch.tensor(r.output_logprobs[switch:]), fresh, atol=1e-4)  # not a recompute


def test_stale_kv_is_checked(model):
    with pytest.raises(ValueError, match="stale_kv: expects 'recompute' or 'keep', got 'drop'"):
        HFEngine(model, stale_kv="drop")


def test_a_busy_batch_gathers_a_few_arrivals_for_a_few_steps(model):
    """One arrival beside 16 decoding rows waits up to gather_steps steps (each admission copies the whole
    running cache); enough arrivals, an abort or an idle batch admit at once."""
    from areal_agents.engines.hf.running_batch import Segment, Submission

    engine = HFEngine(model, gather_steps=2)

    def seq(rid):
        return Submission(rid, [5, 6], SamplingParams(4), set(), None)

    batch = Segment(rows=[seq(str(i)) for i in range(16)])
    engine._scheduler.incoming = [seq("new")]
    assert [engine._scheduler.gathering(batch, aborts=False) for _ in range(4)] == [True, True, False, True]
    assert not engine._scheduler.gathering(batch, aborts=True)
    engine._scheduler.incoming.append(seq("newer"))  # 2 of 16 = GATHER_FRACTION
    assert not engine._scheduler.gathering(batch, aborts=False)
    assert not engine._scheduler.gathering(Segment(), aborts=False)
    eager = HFEngine(model, gather_steps=0)
    eager._scheduler.incoming = [seq("x")]
    assert not eager._scheduler.gathering(batch, aborts=False)


def test_the_kv_cache_changes_rows_and_columns_in_place():
    """Arrivals (narrower and wider than the batch), decode steps and compaction of finished rows give
    the same keys as concatenating and indexing would, in the same buffer: nothing copies the whole cache."""
    from transformers.cache_utils import DynamicLayer

    from areal_agents.engines.hf.kv_buffer import GrowingLayer

    def kv(rows, width):
        return torch.randn(rows, 2, width, 3), torch.randn(rows, 2, width, 3)

    def left_pad(x, width):
        return torch.nn.functional.pad(x, (0, 0, width - x.shape[-2], 0))

    base = DynamicLayer()
    base.update(*kv(4, 10))
    layer = GrowingLayer.adopt(base, max_rows=16)  # room for 8 rows: twice the first batch
    expected = [layer.keys.clone(), layer.values.clone()]
    step = kv(4, 1)  # a decode step: the first one moves the cache into room of its own
    layer.update(*step)
    expected = [torch.cat([e, s], dim=2) for e, s in zip(expected, step)]
    buffer = layer.keys.untyped_storage().data_ptr()
    for rows, width in [(3, 6), (1, 13)]:  # arrivals: narrower, then wider than the running batch
        new = kv(rows, width)
        layer.add_rows(*new)
        w = max(expected[0].shape[2], width)
        expected = [torch.cat([left_pad(e, w), left_pad(x, w)]) for e, x in zip(expected, new)]
        step = kv(8 if rows == 1 else 7, 1)
        layer.update(*step)
        expected = [torch.cat([e, s], dim=2) for e, s in zip(expected, step)]
        assert torch.equal(layer.keys, expected[0]) and torch.equal(layer.values, expected[1])
    # rows 1 and 4 finished: the last two rows take their places; the 2 leading columns are dropped
    layer.keep_rows(torch.tensor([1, 4]), torch.tensor([6, 7]), 6, 2)
    order = [0, 6, 2, 3, 7, 5]
    assert torch.equal(layer.keys, expected[0][order, :, 2:]) and torch.equal(layer.values, expected[1][order, :, 2:])
    assert layer.keys.untyped_storage().data_ptr() == buffer


TINY_CONFIG = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def tiny_llama(**kwargs):
    """A randomly initialised 2-layer Llama on sdpa attention (seed 0: the same weights each call)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, **kwargs}, attn_implementation="sdpa"))


def test_grouped_query_heads_decode_as_transformers_generate():
    """Two KV heads for four query heads, prompts of different lengths joining a running batch in
    segments of their own: the engine gives generate's greedy tokens."""
    from areal_agents.engines.hf.segmented_attention import SEGMENTED_SDPA

    model = tiny_llama(num_key_value_heads=2)
    reference = tiny_llama(num_key_value_heads=2)  # the same weights, left as stock sdpa
    engine = HFEngine(model, eos_token_ids=[])
    assert model.config._attn_implementation == SEGMENTED_SDPA
    prompts = [[3 + i] * (2 + 5 * i) for i in range(4)]

    async def one(i):
        await asyncio.sleep(0.01 * i)
        return await engine.agenerate(GenRequest(str(i), prompts[i], SamplingParams(9 + 3 * i, temperature=0)))

    async def run():
        return await asyncio.gather(*(one(i) for i in range(4)))

    for p, r in zip(prompts, asyncio.run(run())):
        ref = reference.generate(torch.tensor([p]), max_new_tokens=len(r.output_tokens), do_sample=False)
        assert r.output_tokens == ref[0, len(p) :].tolist()


def test_attention_other_than_sdpa_is_refused():
    model = tiny_llama()
    model.set_attn_implementation("eager")
    with pytest.raises(EngineError, match="the model uses 'eager': load it with attn_implementation='sdpa'"):
        HFEngine(model)


def test_a_sequence_past_the_sliding_window_fails_with_the_window_named():
    from transformers import MistralConfig, MistralForCausalLM

    config = {**TINY_CONFIG, "num_hidden_layers": 1, "num_key_value_heads": 2, "sliding_window": 8}
    model = MistralForCausalLM(MistralConfig(**config, attn_implementation="sdpa"))
    engine = HFEngine(model, eos_token_ids=[])

    async def run():
        requests = [
            GenRequest("short", [1, 2, 3], SamplingParams(5, 0)),
            GenRequest("long", [1, 2], SamplingParams(9, 0)),
        ]
        return await asyncio.gather(*(engine.agenerate(r) for r in requests), return_exceptions=True)

    short, long = asyncio.run(run())
    assert len(short.output_tokens) == 5  # within the window, beside a request that passes it
    assert isinstance(long, EngineError) and "'long' reached the model's sliding attention window (8 tokens)" in str(
        long
    )
    again = asyncio.run(engine.agenerate(GenRequest("again", [4], SamplingParams(6, 0))))  # the engine goes on
    assert len(again.output_tokens) == 6


def test_kv_cache_segments_give_the_tokens_of_one_padded_cache(model, tokenizer):
    """Three waves of 16 requests, each arriving 30 decode steps after the one before: with segments
    (each wave's cache as wide as its own rows) the greedy tokens are those of one left-padded cache
    and of generate, with less padding attended."""
    waves = [[(f"{w}{i}*{i + 7}=", 70 - 25 * w + i % 5) for i in range(16)] for w in range(3)]

    def run(max_segments):
        engine = HFEngine(model, eos_token_ids=[], max_segments=max_segments)

        async def wave(w):
            while engine.stats.decode_steps < 30 * w:
                await asyncio.sleep(0.001)
            requests = [
                GenRequest(f"{w}-{i}", prompt(tokenizer, t), SamplingParams(n, 0.0))
                for i, (t, n) in enumerate(waves[w])
            ]
            return await asyncio.gather(*(engine.agenerate(r) for r in requests))

        async def all_waves():
            return await asyncio.gather(*(wave(w) for w in range(3)))

        return [[r.output_tokens for r in responses] for responses in asyncio.run(all_waves())], engine.stats

    segmented, stats = run(8)
    padded, one_cache = run(1)
    assert segmented == padded
    assert one_cache.segments == one_cache.decode_steps and stats.segments > stats.decode_steps
    assert stats.kv_context_cells / stats.kv_cells > one_cache.kv_context_cells / one_cache.kv_cells
    for w in range(3):
        text, n = waves[w][0]
        ids = prompt(tokenizer, text)
        ref = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None)
        assert segmented[w][0] == ref[0, len(ids) :].tolist()


def test_max_segments_is_checked(model):
    with pytest.raises(ValueError, match="max_segments: expects at least 1, got 0"):
        HFEngine(model, max_segments=0)


def test_a_bfloat16_kv_cache_samples_close_to_the_model_through_segments_and_next_turns(model, tokenizer):
    """kv_dtype=bfloat16: the rooms hold bfloat16, prefill runs in the model's dtype (cached prefixes
    converted back), and every logprob stays close to a float32 forward pass of the same tokens."""
    engine = HFEngine(model, eos_token_ids=[], seed=5, kv_dtype="bfloat16")
    episodes = run_multi_turn(engine, tokenizer, 6, 2, lambda i, turn: 12 + (i + turn) % 5)

    async def waves():  # 16 rows 20 decode steps after 16 others: segments of their own
        start = engine.stats.decode_steps

        async def wave(w):
            while engine.stats.decode_steps < start + 20 * w:
                await asyncio.sleep(0.001)
            requests = [GenRequest(f"w{w}.{i}", prompt(tokenizer, f"{w}{i}*3="), SamplingParams(40)) for i in range(16)]
            return await asyncio.gather(*(engine.agenerate(r) for r in requests))

        return await asyncio.gather(wave(0), wave(1))

    steps, segments = engine.stats.decode_steps, engine.stats.segments
    for w, responses in enumerate(asyncio.run(waves())):
        episodes.append([(prompt(tokenizer, f"{w}{i}*3="), r) for i, r in enumerate(responses)])
    assert engine.stats.prefix_hit_tokens > 0 and engine.stats.segments - segments > engine.stats.decode_steps - steps
    assert engine.kv_dtype == torch.bfloat16
    gaps = []
    for turns in episodes:
        for ctx, r in turns:
            ref = forward_logprobs(model, ctx + r.output_tokens, len(r.output_tokens))
            gaps.append((ref - torch.tensor(r.output_logprobs)).abs())
    gaps = torch.cat(gaps)
    assert 0 < gaps.mean() < 0.01 and gaps.max() < 0.25  # bfloat16 keys and values: close, not exact


def test_kv_dtype_is_checked(model):
    with pytest.raises(ValueError, match="kv_dtype: expects one of .*'bfloat16'.*got 'bf16'"):
        HFEngine(model, kv_dtype="bf16")


def test_long_contexts_prefill_in_chunks_with_the_same_tokens_and_logprobs(model, tokenizer, tiny_dir, monkeypatch):
    """A prefill runs PREFILL_CHUNK_TOKENS columns a call (its mask [rows, 1, chunk, context], not [rows, 1,
    W, W]): left-padded rows of different lengths, resumed rows re-running their tokens after a weight
    swap and next turns from the prefix cache all give the logprobs of a full forward pass."""
    from areal_agents.engines.hf import transformers_forward
    from areal_agents.models import load_model

    monkeypatch.setattr(transformers_forward, "PREFILL_CHUNK_TOKENS", 3)
    widths = []
    decoder = model.get_decoder()  # the prefill runs the decoder, then the float32 head on the last position
    forward = decoder.forward

    def spy(*args, **kwargs):
        if kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] > 1:
            widths.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    monkeypatch.setattr(decoder, "forward", spy)
    engine = HFEngine(model, eos_token_ids=[], seed=2, fast_decode=False)
    new_weights, old_weights = perturbed(tiny_dir), load_model(tiny_dir)  # the engine's model takes the new ones
    prompts = [prompt(tokenizer, t) for t in ("1+2=", "34+56=", "345+6789=")]  # a chunk of only padding, too

    async def run():
        tasks = [
            asyncio.ensure_future(engine.agenerate(GenRequest(str(i), p, SamplingParams(30, temperature=0.7))))
            for i, p in enumerate(prompts)
        ]
        while engine.stats.decode_steps < 8:
            await asyncio.sleep(0.001)
        await engine.update_weights(new_weights.state_dict())  # the rows re-run prompt + tokens, in chunks
        return await asyncio.gather(*tasks)

    responses = asyncio.run(run())
    assert widths and max(widths) <= 3 and engine.stats.prefill_tokens > 3 * len(prompts)
    for p, r in zip(prompts, responses):
        switch = r.output_versions.index(1)
        before = forward_logprobs(old_weights, p + r.output_tokens[:switch], switch, temperature=0.7)
        after = forward_logprobs(new_weights, p + r.output_tokens, len(r.output_tokens) - switch, temperature=0.7)
        assert torch.allclose(torch.tensor(r.output_logprobs[:switch]), before, atol=1e-4)
        assert torch.allclose(torch.tensor(r.output_logprobs[switch:]), after, atol=1e-4)
    episodes = run_multi_turn(engine, tokenizer, 3, 3, lambda i, turn: 4 + i)  # next turns: prefix + new columns
    for turns in episodes:
        for ctx, r in turns:
            ref = forward_logprobs(new_weights, ctx + r.output_tokens, len(r.output_tokens))
            assert torch.allclose(torch.tensor(r.output_logprobs), ref, atol=1e-4)
