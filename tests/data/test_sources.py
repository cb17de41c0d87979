"""Dataset names: what they point to locally, what an env server allows, and the shared, bounded caches."""

import json

import pytest

from areal_agents.data.base import CACHED_DATASETS, load_task_dataset, raw_rows
from areal_agents.data.sources import (
    SERVED_DATA_ENV,
    DatasetNotServed,
    ServedData,
    Source,
    datasets_in,
    resolve_source,
    serving,
)
from areal_agents.errors import ArealAgentsError, ConfigError


def write(path, *rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(autouse=True)
def empty_caches():
    raw_rows.cache_clear()
    yield
    raw_rows.cache_clear()


def test_the_caches_are_bounded(tmp_path):
    for i in range(3 * CACHED_DATASETS):
        path = write(tmp_path / f"rows{i}.jsonl", {"prompt": str(i)})
        load_task_dataset(str(path))
        raw_rows(str(path))
    assert raw_rows.cached() <= 2 * CACHED_DATASETS


def test_local_names_load_anything_the_user_names(tmp_path):
    """Outside an env server a user's own config may name any file (the in-process path is unchanged)."""
    path = write(tmp_path / "mine.jsonl", {"prompt": "p"})
    assert resolve_source(str(path)) == Source("file", str(path))
    assert resolve_source("aime24") == Source("bundled", "aime24")
    assert resolve_source("hf:org/name?x=1") == Source("hub", "hf:org/name?x=1")
    with pytest.raises(ArealAgentsError, match="Did you mean 'math500'"):
        resolve_source("math50")


def test_a_server_resolves_only_what_its_operator_allowed(tmp_path):
    named = write(tmp_path / "named.jsonl", {"prompt": "p"})
    (tmp_path / "dir").mkdir()
    write(tmp_path / "dir" / "a.jsonl", {"prompt": "a"})
    (tmp_path / "dir" / "notes.txt").write_text("not a dataset")
    allowed = ServedData.from_args(
        [f"mine={named}", "lcb=hf:livecodebench/code_generation_lite?version_tag=release_v5", "hf:org/set"],
        [str(tmp_path / "dir")],
    )
    with serving(allowed):
        assert resolve_source("mine") == Source("file", str(named))
        assert resolve_source("lcb") == Source("hub", "hf:livecodebench/code_generation_lite?version_tag=release_v5")
        assert resolve_source("hf:org/set") == Source("hub", "hf:org/set")
        assert resolve_source("a.jsonl") == Source("file", str(tmp_path / "dir" / "a.jsonl"))
        assert resolve_source("gsm8k") == Source("bundled", "gsm8k")
        refused = [str(named), "../named.jsonl", "notes.txt", "hf:org/other", "x\0y", "x" * 5000, "/" * 4096, ""]
        for name in refused:
            with pytest.raises(DatasetNotServed, match="not served here"):
                resolve_source(name)
    assert resolve_source(str(named)).kind == "file"  # outside the block, local rules again


def test_a_worker_of_a_server_learns_the_allowed_datasets_from_its_environment(tmp_path, monkeypatch):
    named = write(tmp_path / "named.jsonl", {"prompt": "p"})
    monkeypatch.setenv(SERVED_DATA_ENV, ServedData.from_args([f"mine={named}"]).to_json())
    assert resolve_source("mine") == Source("file", str(named))
    with pytest.raises(DatasetNotServed):
        resolve_source(str(named))


def test_bad_operator_arguments_fail_at_start(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        ServedData.from_args([f"x={tmp_path}/missing.jsonl"])
    with pytest.raises(ConfigError, match="expects NAME=PATH"):
        ServedData.from_args(["x="])
    with pytest.raises(ConfigError, match="not a directory"):
        ServedData.from_args([], [str(tmp_path / "nodir")])


def test_datasets_in_finds_dataset_kwargs_at_any_depth():
    kwargs = {"dataset": "a.jsonl", "task_kwargs": {"dataset": "b.jsonl", "split": "test"}, "other": 1}
    assert datasets_in(kwargs) == ["a.jsonl", "b.jsonl"]
    assert datasets_in({"dataset": ["not", "a", "string"]}) == []
