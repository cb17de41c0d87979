"""`areal-agents sft` data with tool calls: rows read back with their tools, bad rows named by file and line,
and each conversation rendered through the model's template with the row's tools and the template kwargs."""

import json

import pytest

from areal_agents.config import ModelConfig, SFTConfig
from areal_agents.data.jsonl import read_sft_jsonl, write_chat_jsonl
from areal_agents.data.tool_use import REASONING, tool_use_conversations, tools_for
from areal_agents.errors import ArealAgentsError
from areal_agents.models import save_tiny_model
from areal_agents.trainers.sft_recipe import run_sft

CONVERSATIONS = list(tool_use_conversations(2, seed=0, reasoning=True))


def test_tool_use_rows_read_back_with_their_tools(tmp_path):
    path = tmp_path / "sft.jsonl"
    assert write_chat_jsonl(path, CONVERSATIONS, tools=tools_for("+*")) == 2
    path.write_text(path.read_text() + "\n" + json.dumps({"messages": CONVERSATIONS[0]}) + "\n")  # no tools
    examples = read_sft_jsonl(path)
    assert [e.messages for e in examples] == [*CONVERSATIONS, CONVERSATIONS[0]]
    assert [e.tools for e in examples] == [tools_for("+*"), tools_for("+*"), None]
    assert [e.source for e in examples] == [f"{path}:1", f"{path}:2", f"{path}:4"]  # the blank line counts


BAD_ROWS = {
    "no messages": ({"tools": []}, "expects a non-empty list under key 'messages'"),
    "content not a string": ({"messages": [{"role": "user", "content": None}]}, r"messages\[0\]: each message needs"),
    "no assistant": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message to learn from"),
    "call without a name": (
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}]},
        r"messages\[0\]: each tool call needs",
    ),
    "calls on a user message": (
        {"messages": [{"role": "user", "content": "", "tool_calls": []}, {"role": "assistant", "content": "x"}]},
        "'tool_calls' expects a list, on an assistant message",
    ),
    "tools not schemas": (
        {"messages": [{"role": "assistant", "content": "x"}], "tools": [{"name": "add"}]},
        "'tools' expects a list of OpenAI tool schemas",
    ),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_a_bad_row_is_named_by_file_and_line(case, tmp_path):
    row, message = BAD_ROWS[case]
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(ArealAgentsError, match=rf"sft.jsonl:3: .*{message}"):
        read_sft_jsonl(path)


@pytest.fixture(scope="module")
def qwq_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("qwq") / "tiny", family="qwq")


def sft_config(model_dir, tmp_path, data, **kwargs):
    cfg = SFTConfig(run_dir=str(tmp_path / "run"), data=str(data), model=ModelConfig(path=str(model_dir)), **kwargs)
    cfg.eval.num_problems = 0  # run_sft skips its held-out evaluation: the data path alone
    return cfg


def test_sft_trains_on_tool_use_rows_through_the_template(qwq_dir, tmp_path):
    data = tmp_path / "sft.jsonl"
    write_chat_jsonl(data, tool_use_conversations(4, seed=0, reasoning=REASONING["qwq"]), tools=tools_for("+*"))
    summary = run_sft(sft_config(qwq_dir, tmp_path, data, steps=2, batch_size=2), progress=False)
    assert summary["conversations"] == 4 and summary["segments"] == 8  # QwQ drops the call turn's reasoning


def test_a_row_the_template_cannot_render_is_named(tmp_path):
    mistral = save_tiny_model(tmp_path / "mistral", family="mistral")
    data = tmp_path / "sft.jsonl"
    good = list(tool_use_conversations(1, seed=0, reasoning=False))[0]
    bad = [dict(m, tool_call_id="call1") if m["role"] == "tool" else m for m in good]  # Mistral: 9 characters
    data.write_text(json.dumps({"messages": good}) + "\n" + json.dumps({"messages": bad}) + "\n")
    with pytest.raises(ArealAgentsError, match=r"sft.jsonl:2: the chat template cannot render .*length 9"):
        run_sft(sft_config(mistral, tmp_path, data, steps=1, batch_size=1), progress=False)
