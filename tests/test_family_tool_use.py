"""Models that really call tools (issue 31, item 6 and the first acceptance line), for each model family.

(1) The synthetic tool-use SFT data, rendered through each family's own template: every assistant turn's loss
tokens are what the family writes for it, and its parser reads the same call back. (2) A malformed call in each
family's format is counted and answered with its error, which the model reads next. (3) Per family, through
the CLI as examples/tool_use/run.sh runs it: ``tiny-model --family`` -> ``sft`` on the family's tool-use data
-> 2 ``train`` steps of ``ToolAgent``; from the dumped trajectories and the metrics: loss-mask runs are the
sampled turns, behavior logprobs equal a fresh forward pass, the model called tools, and the segments are those
the family's template implies.
"""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_agents.agents.chat_tokens import ChatTokens
from areal_agents.agents.tool_agent import ToolAgent
from areal_agents.chat.parsers import ReplyParser
from areal_agents.cli import main
from areal_agents.data.tool_use import REASONING, TOOL_SCHEMAS, add, multiply, tool_names, tool_use_conversations
from areal_agents.envs.tools import tool_schema
from areal_agents.models import load_model, load_tokenizer
from areal_agents.models.families import build_family_tokenizer, stop_token_ids
from areal_agents.trainers.batching import make_micro_batches, token_logprobs
from areal_agents.trainers.sft import conversation_to_segments
from areal_agents.types import SamplingParams, Trajectory

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tool_use"
FAMILIES = ("qwen3", "qwq", "deepseek-r1", "mistral", "gpt-oss", "granite")
# Segments of one SFT conversation (user, call, tool result, answer), from each template's own rules:
# Qwen3 keeps reasoning in a tool loop after the last user message; QwQ drops it from every non-final
# assistant turn and DeepSeek-R1 renders a past call turn without its `<think>` part (both: a new segment
# at the tool result); gpt-oss keeps the analysis before a call until a final answer follows (the answer
# ends the conversation); Mistral and Granite carry no reasoning.
SFT_SEGMENTS = {"qwen3": 1, "qwq": 2, "deepseek-r1": 2, "mistral": 1, "gpt-oss": 1, "granite": 1}
# In RL (one user turn, then a tool loop) by the same rules: QwQ and DeepSeek-R1 rewrite the answered turn
# (each episode whose reply was answered as a tool call has more than one segment); Qwen3 keeps the reasoning
# inside the loop, gpt-oss keeps the analysis until the final answer (which ends the episode), Mistral and
# Granite have none to drop: one trajectory an episode. In every family a sampled turn that the template
# writes back otherwise (a Mistral call id that is not 9 characters, gpt-oss's `<|channel|>finalysis`, JSON
# spaced otherwise) also starts a segment there: never a silent drift.
RL_REWRITES = {"qwen3": False, "qwq": True, "deepseek-r1": True, "mistral": False, "gpt-oss": False, "granite": False}
# A malformed call (arguments that are not JSON) as each family writes a call.
MALFORMED = {
    "qwen3": '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',
    "qwq": '</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',
    "deepseek-r1": "</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
    '{"a": 1,}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1,}}]',
    "gpt-oss": ' to=functions.add<|channel|>commentary json<|message|>{"a": 1,}',
    "granite": '<|tool_call|>[{"name": "add", "arguments": {"a": 1,}}]',
}
MAX_NEW_TOKENS = 48


def loss_runs(input_ids, loss_mask):
    """``(start, tokens)`` of each maximal run of loss tokens, in order."""
    runs, start = [], None
    for i, m in enumerate([*loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, input_ids[start:i]))
            start = None
    return runs


def test_tool_schemas_are_what_tool_schema_makes():
    assert TOOL_SCHEMAS == [tool_schema(add), tool_schema(multiply)]


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_turns_are_the_family_format_and_parse_back(family):
    tokenizer = build_family_tokenizer(family)
    parser = ReplyParser.for_template(tokenizer.chat_template)
    stops = stop_token_ids(tokenizer)
    for conversation in tool_use_conversations(6, seed=0, reasoning=REASONING[family]):
        segments = conversation_to_segments(conversation, tokenizer, TOOL_SCHEMAS)
        assert len(segments) == SFT_SEGMENTS[family]
        runs = [run for s in segments for _, run in loss_runs(s.input_ids, s.loss_mask)]
        expected = [m for m in conversation if m["role"] == "assistant"]
        assert len(runs) == len(expected) == 2  # loss on the assistant turns only, one run each
        for run, message in zip(runs, expected):
            assert run[-1] in stops and not any(t in stops for t in run[:-1])
            reply = parser.parse(tokenizer.decode(run[:-1], skip_special_tokens=False))
            assert reply.errors == []
            calls = [(c.name, c.arguments) for c in reply.tool_calls]
            assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
            if family == "mistral":  # the one format that carries the call id
                assert [c.id for c in reply.tool_calls] == [c["id"] for c in message.get("tool_calls", [])]
            assert reply.content == message["content"]
            if REASONING[family] and message.get("tool_calls"):
                assert reply.reasoning == message["reasoning_content"]
            elif not REASONING[family]:
                assert not reply.reasoning


@pytest.mark.parametrize("family", FAMILIES)
def test_a_malformed_call_is_counted_and_the_model_reads_its_error(family):
    """The ToolAgent's turn as `ChatAgent._play` runs it, on a reply the model could have sampled: a call in
    the family's format whose arguments are not JSON."""
    tokenizer = build_family_tokenizer(family)
    agent = ToolAgent(None, tokenizer, SamplingParams(MAX_NEW_TOKENS), tools=tool_names("+"))
    chat = agent.new_chat()
    chat.start([{"role": "user", "content": "1+2="}])
    sampled = tokenizer.encode(MALFORMED[family], add_special_tokens=False) + [stop_token_ids(tokenizer)[0]]
    text = chat.append_generation(sampled, [0.0] * len(sampled), [0] * len(sampled))
    reply = chat.last_reply
    assert reply.tool_calls == [] and len(reply.errors) == 1  # what rollout/tool_parse_failures sums
    assert "not valid JSON" in reply.errors[0].message
    answered = asyncio.run(agent.answer(reply, text))
    assert answered and str(reply.errors[0]) in answered[-1]["content"]
    before = len(chat.input_ids)
    if not chat.append_messages(answered):  # the template rewrote the turn: the agent's next segment
        old, chat, before = chat, agent.new_chat(), 0
        chat.start([*old.messages, *answered])
    prompt = tokenizer.decode(chat.input_ids[before:], skip_special_tokens=False)
    assert "not valid JSON" in prompt, f"{family}: the error is not in what the model reads next: {prompt!r}"


@pytest.fixture(scope="module")
def warm_models(tmp_path_factory):
    """Per family, built on first use as examples/tool_use/run.sh builds it: ``tiny-model --family``, the
    family's tool-use data (make_sft_data.py), ``sft`` with examples/tool_use/sft.yaml."""
    cache = {}

    def get(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(family.replace("-", "_"))
            assert main(["tiny-model", str(root / "tiny"), "--family", family]) == 0
            make = [sys.executable, str(EXAMPLE / "make_sft_data.py"), str(root / "sft.jsonl"), "--family", family]
            subprocess.run(make, check=True, capture_output=True, text=True)
            overrides = [f"model.path={root / 'tiny'}", f"data={root / 'sft.jsonl'}", f"run_dir={root / 'sft'}"]
            assert main(["sft", str(EXAMPLE / "sft.yaml"), *overrides, "--no-progress"]) == 0
            cache[family] = root / "sft" / "model"
        return cache[family]

    return get


def _check_turns(row, tokenizer, parser, stops, recorder):
    """Each loss run is one sampled turn (ending at a stop token, or cut at the token budget) and parses to the
    assistant message the agent recorded for it: the segment's last ones."""
    replies = [m for m in row["metadata"]["messages"] if m["role"] == "assistant"]
    runs = loss_runs(row["input_ids"], row["loss_mask"])
    assert 1 <= len(runs) <= len(replies)
    read_from = 0  # where the tokens the template added for this turn begin (the previous turn's end)
    for (start, tokens), message in zip(runs, replies[len(replies) - len(runs) :]):
        assert not any(t in stops for t in tokens[:-1])
        assert tokens[-1] in stops or len(tokens) <= MAX_NEW_TOKENS
        body = tokens[:-1] if tokens[-1] in stops else tokens
        # a <think> the template opened for this turn (not one a malformed earlier reply left in the history)
        prompt = tokenizer.decode(row["input_ids"][read_from:start], skip_special_tokens=False)
        read_from = start + len(tokens)
        opened = prompt[prompt.rfind("<think>") :] if prompt.rfind("<think>") > prompt.rfind("</think>") else ""
        raw = opened + tokenizer.decode(body, skip_special_tokens=False)  # the turn as ChatTokens reads it
        reply = parser.parse(raw)
        # the recorded message is this turn's (call ids aside: a format without one gets a fresh id each parse)
        assert _without_ids(message) == _without_ids(recorder.assistant_message(reply, raw))
        if "tool_calls" in message:  # the template reads calls: those the parser found in the sampled tokens
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            assert calls == [(c.name, c.arguments) for c in reply.tool_calls] != []


def _without_ids(message):
    calls = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls", [])]
    return {**message, "tool_calls": calls}


def _check_logprobs(row, models):
    """Behavior logprobs equal a fresh forward pass of the weights that sampled them (by token version)."""
    traj = Trajectory(row["input_ids"], row["loss_mask"], row["logprobs"], row["versions"])
    (mb,) = make_micro_batches([traj], 8192)
    mask = mb.loss_mask[0].bool()
    versions = {row["versions"][i] for i in mask.nonzero().flatten().tolist()}
    for version in versions:
        with torch.no_grad():
            ref = token_logprobs(models(version), mb, temperature=1.0)[0]
        sampled = mask & torch.tensor([v == version for v in row["versions"]])
        assert torch.allclose(mb.logprobs[0][sampled], ref[sampled], atol=1e-4)


@pytest.mark.slow  # 30-60 s each on 2 cores: kept out of the default run
@pytest.mark.process
@pytest.mark.parametrize("family", FAMILIES)
def test_tool_agent_rl_through_the_cli(family, warm_models, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sft_model, run = warm_models(family), tmp_path / "rl"
    small = ["steps=2", "save_every=1", "rollout.batch_size=2", "rollout.group_size=2", "eval.num_problems=1"]
    overrides = [f"model.path={sft_model}", f"run_dir={run}", "rollout.dump_trajectories=true", *small]
    assert main(["train", str(EXAMPLE / "rl.yaml"), *overrides, "--no-progress"]) == 0
    tokenizer = load_tokenizer(sft_model)
    parser = ReplyParser.for_template(tokenizer.chat_template)
    stops = stop_token_ids(tokenizer)
    recorder = ChatTokens(tokenizer, parser=parser)  # how the agent records a sampled turn as a message
    cache = {}

    def models(version):  # version 0 is the warm start; version v the weights after step v
        if version not in cache:
            checkpoint = run / "checkpoints" / f"step_{version}" / "model"
            cache[version] = load_model(sft_model if version == 0 else checkpoint)
        return cache[version]

    episodes = {}
    for step in (1, 2):
        rows = [json.loads(line) for line in (run / "trajectories" / f"step_{step}.jsonl").read_text().splitlines()]
        assert rows
        for row in rows:
            episodes.setdefault(row["episode_id"], []).append(row)
            _check_turns(row, tokenizer, parser, stops, recorder)
            _check_logprobs(row, models)
    scalars = EventAccumulator(str(run / "tensorboard")).Reload()
    calls = [e.value for e in scalars.Scalars("rollout/tool_calls_per_episode")]
    assert max(calls) > 0, f"{family}: the model never made a tool call the parser read"
    # segments: as the family's template implies, in the dump and in rollout/segments_per_episode
    for segments in episodes.values():
        meta = segments[0]["metadata"]
        # dumped: the segments with loss tokens (all but, at most, a last one opened by an unanswered message)
        assert meta["num_segments"] - 1 <= len(segments) <= meta["num_segments"]
        for before, after in zip(segments, segments[1:]):  # a split only where the render does not extend
            assert after["input_ids"][: len(before["input_ids"])] != before["input_ids"]
        if RL_REWRITES[family] and meta["tool_calls"] + meta["tool_parse_failures"] > 0:
            assert len(segments) >= 2, f"{family}: the template drops the answered turn's reasoning"
    if not RL_REWRITES[family]:  # a tool loop as such keeps one trajectory (a turn the model wrote otherwise
        # than the template writes it back still splits, as checked above)
        singles = [s for s in episodes.values() if len(s) == 1 and s[0]["metadata"]["tool_calls"] > 0]
        assert singles, f"{family}: no episode with a tool call kept one trajectory"
    per_episode = [e.value for e in scalars.Scalars("rollout/segments_per_episode")]
    assert (max(per_episode) > 1) if RL_REWRITES[family] else (min(per_episode) < 2)
