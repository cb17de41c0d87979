import pytest

from areal_agents.data import read_chat_jsonl, write_chat_jsonl
from areal_agents.errors import ArealAgentsError


def test_written_conversations_read_back_the_same(tmp_path):
    conversations = [
        [{"role": "user", "content": "count 3..5="}, {"role": "assistant", "content": "3 4 5"}],
        [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "é"}],
    ]
    path = tmp_path / "new" / "dir" / "sft.jsonl"  # parents are made
    assert write_chat_jsonl(path, iter(conversations)) == 2
    assert read_chat_jsonl(path) == conversations


def test_a_conversation_without_an_assistant_turn_is_named_on_reading(tmp_path):
    path = tmp_path / "sft.jsonl"
    write_chat_jsonl(path, [[{"role": "user", "content": "hi"}]])
    with pytest.raises(ArealAgentsError, match=r"sft.jsonl: row 1: no assistant message"):
        read_chat_jsonl(path)
