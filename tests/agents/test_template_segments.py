"""Token-exact conversations over the six real chat templates (issue 31, item 3): random multi-turn
conversations (system prompts, tools, tool rounds, reasoning, unicode and whitespace) played through
`ChatTokens` as an agent plays them. Every appended turn either extends the tokens so far exactly (and equals
the template's own render of the conversation) or starts a new segment, never a silent drift; the loss mask
covers exactly the sampled tokens; and the number of segments is the one each template's own rules imply."""

from __future__ import annotations

import asyncio
import functools
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from test_custom_agents import masked_runs

from areal_agents.agents import ChatAgent, ToolAgent
from areal_agents.agents.assistant_turns import assistant_turn_text, through_first_stop
from areal_agents.agents.capture import ChatCapture
from areal_agents.agents.chat_tokens import ChatTokens
from areal_agents.chat.template_messages import template_message
from areal_agents.data.tool_use import TOOL_SCHEMAS, add, multiply
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.envs.runtime.pool import LocalEnvPool
from areal_agents.models import load_model, load_tokenizer, save_tiny_model
from areal_agents.models.families import build_family_tokenizer
from areal_agents.trainers.batching import make_micro_batches, token_logprobs
from areal_agents.types import SamplingParams

FAMILIES = ("qwen3", "qwq", "deepseek-r1", "mistral", "gpt-oss", "granite")
REASONING = {"qwen3", "qwq", "deepseek-r1", "gpt-oss"}  # families whose replies carry reasoning
CONVERSATIONS = 200  # per family (issue 31's acceptance: >= 200 random conversations per family in CI)
WORDS = ("add", "the", "numbers", "naïve", "数学", "🙂", "Ωmega", "x=3", "(a+b)", "résumé", "42", "tab\there", "ok")


@functools.cache
def tokenizer(family: str):
    return build_family_tokenizer(family)


def text(rng: random.Random, tag: str = "") -> str:
    """A random text: words (some unicode), spaces, the odd inner newline; ``tag`` keeps it unique."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 6))]
    body = "".join(w + rng.choice((" ", " ", "  ", "\n")) for w in words).strip()
    return f"{tag}{body}" if tag else body


@dataclass
class Round:
    """One tool round: an assistant turn with calls, then a result message per call."""

    call: dict[str, Any]
    results: list[dict[str, Any]]


@dataclass
class UserTurn:
    user: dict[str, Any]
    rounds: list[Round] = field(default_factory=list)
    answer: dict[str, Any] = field(default_factory=dict)


@dataclass
class Conversation:
    system: str | None
    tools: list[dict[str, Any]] | None
    turns: list[UserTurn]

    def first_messages(self) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, self.turns[0].user]


def random_conversation(family: str, rng: random.Random) -> Conversation:
    tools = TOOL_SCHEMAS if rng.random() < 0.6 else None
    system = text(rng, "sys: ") if rng.random() < 0.5 else None
    turns = []
    for u in range(rng.randint(1, 3)):
        turn = UserTurn({"role": "user", "content": text(rng, f"q{u}: ")})
        for _ in range(rng.randint(0, 2) if tools else 0):
            calls = [_random_call(rng) for _ in range(1 if family == "gpt-oss" else rng.randint(1, 2))]
            # Mistral and gpt-oss render no content beside calls; DeepSeek-R1 renders it as a turn of its own
            # after the calls' `<｜end▁of▁sentence｜>` (template: `message['content'] is not none` after the calls).
            plain = family in ("mistral", "gpt-oss", "deepseek-r1")
            content = "" if plain or rng.random() < 0.5 else text(rng)
            call = {"role": "assistant", "content": content, "tool_calls": calls}
            _maybe_reasoning(family, rng, call)
            results = [
                {"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"], "content": text(rng)}
                for c in calls
            ]
            turn.rounds.append(Round(call, results))
        turn.answer = {"role": "assistant", "content": text(rng)}
        if not (family == "deepseek-r1" and turn.rounds):
            # DeepSeek-R1 prompts for no turn after tool outputs (no `<｜Assistant｜><think>`) and renders the
            # answer there as written: the answer to tool outputs carries no reasoning.
            _maybe_reasoning(family, rng, turn.answer)
        turns.append(turn)
    return Conversation(system, tools, turns)


def _random_call(rng: random.Random) -> dict[str, Any]:
    name = rng.choice(("add", "multiply"))
    arguments: dict[str, Any] = {"a": rng.randint(-99, 999), "b": rng.randint(0, 99)}
    if rng.random() < 0.3:
        arguments["note"] = text(rng)
    call_id = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(9))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _maybe_reasoning(family: str, rng: random.Random, message: dict[str, Any]) -> None:
    if family in REASONING and rng.random() < 0.6:
        message["reasoning_content"] = text(rng, "think: ")


def steps(conversation: Conversation) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each assistant turn with the messages that follow it (tool results, the next user message, or none)."""
    out = []
    for i, turn in enumerate(conversation.turns):
        for r in turn.rounds:
            out.append((r.call, r.results))
        following = [conversation.turns[i + 1].user] if i + 1 < len(conversation.turns) else []
        out.append((turn.answer, following))
    return out


def render_ids(family: str, messages: list[dict[str, Any]], tools, generation_prompt: bool = True) -> list[int]:
    """The template's own render of ``messages``, tokenized (assistant messages in the fields it reads)."""
    tok = tokenizer(family)
    messages = [template_message(tok.chat_template, m) if m["role"] == "assistant" else m for m in messages]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
    return tok.encode(text, add_special_tokens=False)


def chatml_new_messages(family: str, messages: list[dict[str, Any]], tools) -> str:
    """What a ChatML template (Qwen3, QwQ) renders after the last assistant turn's `<|im_end|>`: the one block
    of the new messages (a user message, or the tool results grouped as one user turn), then the generation
    prompt."""
    tok = tokenizer(family)
    full = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    at = full.rfind("<|im_start|>", 0, full.rfind("<|im_start|>"))  # the block before the generation prompt
    assert full[at - len("<|im_end|>\n") : at] == "<|im_end|>\n"
    return full[at - 1 :]


def play(family: str, conversation: Conversation, *, keep_reasoning: bool = False) -> list[ChatTokens]:
    """Play ``conversation`` as `ChatAgent` does, each assistant turn sampled as the tokens a model writes for
    it; check every step; return the segments."""
    tok, tools = tokenizer(family), conversation.tools
    chat = ChatTokens(tok, tools=tools, keep_reasoning=keep_reasoning)
    chat.start(conversation.first_messages())
    assert chat.input_ids == render_ids(family, conversation.first_messages(), tools)
    segments: list[ChatTokens] = []
    sampled: list[list[list[int]]] = [[]]  # per segment, the sampled turns in order
    for message, following in steps(conversation):
        turn = through_first_stop(tok, chat.stop_ids, assistant_turn_text(tok, chat.messages, message, tools=tools))
        chat.append_generation(turn, [0.0] * len(turn), [0] * len(turn))
        sampled[-1].append(turn)
        check_reply(family, chat, message)
        if not following:
            break
        before = chat.input_ids + ([] if turn[-1] in chat.stop_ids else [chat.stop_ids[0]])
        if chat.append_messages(following):
            if keep_reasoning:  # the sampled turns kept as they are, then what the template renders after them
                assert chat.input_ids[: len(before)] == before
                added = tok.decode(chat.input_ids[len(before) :], skip_special_tokens=False)
                assert added == chatml_new_messages(family, chat.messages, tools)
            else:
                assert chat.input_ids == render_ids(family, chat.messages, tools)  # no silent drift
            continue
        assert render_ids(family, [*chat.messages, *following], tools)[: len(before)] != before  # no extension
        segments.append(chat)
        chat = ChatTokens(tok, tools=tools, keep_reasoning=keep_reasoning)
        chat.start([*segments[-1].messages, *following])
        assert chat.input_ids == render_ids(family, chat.messages, tools)  # the new segment's prompt: the render
        sampled.append([])
    segments.append(chat)
    for segment, turns in zip(segments, sampled):
        assert masked_runs(segment) == turns  # loss on exactly the sampled tokens
    return segments


def check_reply(family: str, chat: ChatTokens, message: dict[str, Any]) -> None:
    """The parsed reply has the scripted calls and reasoning."""
    reply = chat.last_reply
    assert reply.errors == []
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert [(c.name, c.arguments) for c in reply.tool_calls] == expected
    if family == "mistral":
        assert [c.id for c in reply.tool_calls] == [c["id"] for c in message.get("tool_calls", [])]
    if family in REASONING:
        assert (reply.reasoning or None) == (message.get("reasoning_content") or None)
    assert reply.content == message["content"].strip()


@pytest.mark.parametrize("family", FAMILIES)
def test_random_conversations_extend_exactly_or_start_a_segment(family):
    rng = random.Random(f"segments-{family}")
    for _ in range(CONVERSATIONS):
        conversation = random_conversation(family, rng)
        segments = play(family, conversation)
        assert len(segments) == EXPECTED_SEGMENTS[family](conversation), conversation


# The segments of a conversation, from each template's own rules (one new segment per append whose render
# does not extend the tokens so far). Line numbers are those of areal_agents/models/templates/<family>.jinja.


def qwen3_segments(c: Conversation) -> int:
    """qwen3.jinja:39-40 renders a `<think>` block only after the last user query, and there only on the
    last turn or where the reasoning is non-empty. The sampled turn always has the block (it was the last
    turn when sampled: an empty `<think>\n\n</think>\n\n` when it had no reasoning), so: a new user message
    drops every block of the exchange before it (a new segment), and a tool result after a call turn
    without reasoning drops that turn's empty block (a new segment); calls with reasoning extend."""
    bare_calls = sum(1 for t in c.turns for r in t.rounds if not r.call.get("reasoning_content"))
    return len(c.turns) + bare_calls


def qwq_segments(c: Conversation) -> int:
    """qwq.jinja:25/31 keeps only the text after `</think>` of every assistant turn but the last, and the
    generation prompt opened `<think>\n` (line 57), so every turn followed by a message starts a new segment."""
    return sum(len(t.rounds) + 1 for t in c.turns)


def deepseek_segments(c: Conversation) -> int:
    """deepseek-r1.jinja:32 keeps only the text after `</think>` of a turn prompted by `<｜Assistant｜><think>\n`
    (line 46), so a turn answering a user message is rewritten; a call turn after tool outputs is too (line 17:
    `<｜tool▁calls▁begin｜>` only for the conversation's first call, and no `<｜tool▁outputs▁end｜>` before it).
    An answer to tool outputs is rendered as written (line 28): the next user message extends it."""
    rewritten = sum(len(t.rounds) + 1 for t in c.turns) - 1  # every turn followed by a message ...
    return 1 + rewritten - sum(1 for t in c.turns[:-1] if t.rounds)  # ... but answers to tool outputs


def mistral_segments(c: Conversation) -> int:
    """mistral.jinja:51 writes the system prompt only into the user message that is the conversation's last
    message, and line 27 `[AVAILABLE_TOOLS]` before the last user message. So a first call after the user
    message drops the system prompt (a new segment); a new user message moves the tool list (a new segment),
    and moves the system prompt where the user message before it still carried it (an exchange without
    tool rounds); tool results extend."""
    calls = sum(1 for t in c.turns if t.rounds) if c.system else 0
    moves = sum(1 for t in c.turns[:-1] if c.tools or (c.system and not t.rounds))
    return 1 + calls + moves


def gpt_oss_segments(c: Conversation) -> int:
    """gpt-oss.jinja:311/314: the model ends its final answer with `<|return|>`, a past final answer renders
    with `<|end|>` (its analysis dropped), so every new user message starts a segment. Line 280/292-294 keep a
    call's analysis until a final answer follows, which only happens at that new user message: tool results
    extend."""
    return len(c.turns)


EXPECTED_SEGMENTS = {
    "qwen3": qwen3_segments,
    "qwq": qwq_segments,
    "deepseek-r1": deepseek_segments,
    "mistral": mistral_segments,
    "gpt-oss": gpt_oss_segments,
    "granite": lambda c: 1,  # granite.jinja renders every message as written, in place: never a rewrite
}


@pytest.mark.parametrize("family", ("qwen3", "qwq"))
def test_keep_reasoning_keeps_one_segment(family):
    """With ``keep_reasoning`` the same conversations stay one trajectory: the sampled turns verbatim, each
    appended part what the template renders for the new messages."""
    rng = random.Random(f"segments-{family}")
    for _ in range(CONVERSATIONS):
        assert len(play(family, random_conversation(family, rng), keep_reasoning=True)) == 1


class Recording(InferenceEngine):
    """An engine that records the tokens it sampled, in order (the loss mask must cover exactly these)."""

    def __init__(self, engine):
        self.engine, self.sampled = engine, []

    async def agenerate(self, request):
        response = await self.engine.agenerate(request)
        self.sampled.append(list(response.output_tokens))
        return response

    async def aclose(self):
        await self.engine.aclose()


def assert_token_exact(model, trajectories, sampled):
    """The loss runs are the sampled turns, in order; behavior logprobs equal a fresh forward pass."""
    assert [run for t in trajectories for run in masked_runs(t)] == [s for s in sampled if s]
    for traj in trajectories:
        (mb,) = make_micro_batches([traj], 8192)
        with torch.no_grad():
            ref = token_logprobs(model, mb, temperature=1.0)[0]
        mask = mb.loss_mask[0].bool()
        assert torch.allclose(mb.logprobs[0][mask], ref[mask], atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_agents_and_capture_on_a_real_engine_are_token_exact(family, tmp_path):
    """ChatAgent, ToolAgent and ChatCapture on each family's tiny model (random weights, temperature 1)."""
    save_tiny_model(tmp_path, hidden_size=32, num_layers=1, intermediate_size=64, family=family)
    tok, sampling = load_tokenizer(tmp_path), SamplingParams(max_new_tokens=12, temperature=1.0)
    fresh = load_model(tmp_path)

    async def episodes():
        out = []
        for seed, agent_class in enumerate((ChatAgent, ChatAgent, ToolAgent, ToolAgent)):
            engine = Recording(HFEngine(load_model(tmp_path), seed=seed))
            kwargs = {"tools": [add, multiply]} if agent_class is ToolAgent else {}
            agent = agent_class(engine, tok, sampling, system_prompt="Be brief.", **kwargs)
            env = LocalEnvPool("inline").make("areal_agents/Arithmetic-v0", digits=1, max_turns=3)
            trajectories = await agent.run_episode(env, seed=seed, episode_id=f"ep{seed}")
            out.append((trajectories, engine.sampled))
            await engine.aclose()
        engine = Recording(HFEngine(load_model(tmp_path), seed=9))
        capture = ChatCapture(engine, tok, sampling, episode_id="cap")
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}]
        for question in ("3*4=", "5+6="):
            reply = await capture.client.chat.completions.create(model="policy", messages=messages, tools=TOOL_SCHEMAS)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
            messages += [{"role": "user", "content": question}]
        capture.set_reward(1.0)
        out.append((capture.trajectories(), engine.sampled))
        await engine.aclose()
        return out

    for trajectories, sampled in asyncio.run(episodes()):
        assert trajectories
        assert_token_exact(fresh, trajectories, sampled)
        for traj in trajectories:
            if "num_segments" in traj.metadata:
                assert traj.metadata["num_segments"] == len(trajectories)
