import asyncio

from areal_agents.agents import ChatAgent
from areal_agents.engines import HFEngine
from areal_agents.envs import LocalEnvPool
from areal_agents.trainers.sft import conversation_to_trajectory
from areal_agents.types import SamplingParams


class RecordingEngine(HFEngine):
    """The real engine, also keeping every response it returned."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.responses = []

    async def agenerate(self, request):
        response = await super().agenerate(request)
        self.responses.append(response)
        return response


def run_episode(model, tokenizer, max_turns=3, seed=0):
    engine = RecordingEngine(model, seed=seed)
    agent = ChatAgent(engine, tokenizer, SamplingParams(max_new_tokens=6))
    env = LocalEnvPool("inline").make("areal_agents/Arithmetic-v0", max_turns=max_turns)
    (traj,) = asyncio.run(agent.run_episode(env, seed=seed, episode_id="ep"))
    return traj, engine.responses


def loss_runs(traj):
    """Contiguous runs of loss tokens, as lists of token ids."""
    runs, current = [], []
    for tok, m in zip(traj.input_ids, traj.loss_mask):
        if m:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_loss_mask_covers_exactly_the_generated_tokens(model, tokenizer):
    # The untrained model babbles (special tokens mid-text included), which re-tokenization would alter.
    traj, responses = run_episode(model, tokenizer, max_turns=3)
    assert len(responses) == 3 == traj.metadata["num_turns"]
    assert loss_runs(traj) == [r.output_tokens for r in responses]
    gen = [lp for r in responses for lp in r.output_logprobs]
    assert [lp for lp, m in zip(traj.logprobs, traj.loss_mask) if m] == gen
    assert all(v == -1 for v, m in zip(traj.versions, traj.loss_mask) if not m)
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask) if not m)


def test_prompt_tokens_are_the_chat_template_render(model, tokenizer):
    traj, responses = run_episode(model, tokenizer, max_turns=2)
    first = traj.loss_mask.index(1)
    user = traj.metadata["messages"][0]
    expected = tokenizer.apply_chat_template([user], add_generation_prompt=True, return_dict=False)
    assert traj.input_ids[:first] == expected
    # Between the turns: EOS if turn 1 was cut off, then the template's text after the assistant's EOS.
    end1 = first + len(responses[0].output_tokens)
    start2 = end1 + [i for i, m in enumerate(traj.loss_mask[end1:]) if m][0]
    eos = tokenizer.eos_token_id
    between = ([] if responses[0].output_tokens[-1] == eos else [eos]) + tokenizer.encode(
        f"\n<|im_start|>user\nWrong. Try again: {user['content']}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert traj.input_ids[end1:start2] == between


def test_sft_conversation_matches_the_agent_layout(tokenizer):
    msgs = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "Wrong. Try again: 1+1="},
        {"role": "assistant", "content": "2"},
    ]
    traj = conversation_to_trajectory(msgs, tokenizer)
    full = tokenizer.apply_chat_template(msgs, return_dict=False)
    assert traj.input_ids == full[:-1]  # everything the template renders, up to the final EOS
    eos = tokenizer.eos_token_id
    assert loss_runs(traj) == [tokenizer.encode("3") + [eos], tokenizer.encode("2") + [eos]]


def test_the_engines_stop_reason_of_each_turn_is_recorded(model, tokenizer):
    traj, responses = run_episode(model, tokenizer, max_turns=3)
    assert traj.metadata["stop_reasons"] == [r.stop_reason for r in responses]
    assert set(traj.metadata["stop_reasons"]) <= {"stop", "length"} and len(responses) >= 1
