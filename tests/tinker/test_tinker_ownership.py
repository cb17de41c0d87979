"""Sessions and their ids, tinker:// checkpoint paths kept under the root, and the base-model registry."""

from __future__ import annotations

import pytest

from areal_agents.errors import RequestError
from areal_agents.models.tiny import FAMILY_CHOICES
from areal_agents.tinker.ownership import (
    BaseModels,
    CheckpointPaths,
    NotFound,
    SessionBook,
    SessionFinished,
)


def test_a_session_owns_the_model_and_sampler_ids_the_sdk_expects():
    book = SessionBook()
    session = book.create(tags=["t"], user_metadata=None)
    sid = session.session_id
    assert sid.startswith("sess-") and ":" not in sid
    model_id = book.new_model_id(sid, 0)
    assert model_id == f"{sid}:train:0"  # service_client.py:400 builds exactly this for create-via-load
    assert book.session_of_model(model_id) is session
    sampler_id = book.new_sampler_id(sid, 3)
    assert sampler_id == f"{sid}:sample:3" and book.session_of_sampler(sampler_id) is session


def test_taken_or_negative_seq_ids_are_the_clients_mistake():
    book = SessionBook()
    sid = book.create([], {}).session_id
    book.new_model_id(sid, 0)
    with pytest.raises(RequestError, match="model_seq_id: model 'sess-.*:train:0' already exists"):
        book.new_model_id(sid, 0)
    with pytest.raises(RequestError, match="model_seq_id: expects 0 <= id"):
        book.new_model_id(sid, -1)
    book.new_sampler_id(sid, 0)
    with pytest.raises(RequestError, match="sampling_session_seq_id: sampler .* exists"):
        book.new_sampler_id(sid, 0)


def test_unknown_and_unregistered_ids_are_not_found():
    book = SessionBook()
    sid = book.create([], {}).session_id
    with pytest.raises(NotFound, match="session_id: no session 'sess-nope'"):
        book.get("sess-nope")
    with pytest.raises(NotFound, match="model_id: no model"):
        book.session_of_model(f"{sid}:train:5")  # well formed, never created
    with pytest.raises(NotFound, match="model_id: no model"):
        book.session_of_model("../../etc:train:0")
    with pytest.raises(NotFound, match="sampling_session_id: no sampler"):
        book.session_of_sampler(f"{sid}:train:0")


def test_a_finished_session_is_gone_for_everything_but_finish_again():
    clock = iter([1.0, 2.0, 3.0]).__next__
    book = SessionBook(clock=clock)
    session = book.create([], {})
    book.heartbeat(session.session_id)
    assert session.last_heartbeat == 2.0
    model_id = book.new_model_id(session.session_id, 0)
    assert book.finish(session.session_id) is session and book.finish(session.session_id).finished
    with pytest.raises(SessionFinished):
        book.heartbeat(session.session_id)
    with pytest.raises(SessionFinished):
        book.session_of_model(model_id)


def test_open_sessions_are_capped():
    book = SessionBook(max_sessions=1)
    first = book.create([], {})
    with pytest.raises(RequestError, match="1 sessions are open"):
        book.create([], {})
    book.finish(first.session_id)
    book.create([], {})  # a finished one no longer counts


def test_checkpoints_map_to_directories_under_the_root(tmp_path):
    paths = CheckpointPaths(tmp_path)
    model_id = "sess-0123456789abcdef:train:0"
    ref = paths.for_save(model_id, "weights", "c1")
    assert ref.uri == f"tinker://{model_id}/weights/c1"
    assert ref.path == tmp_path.resolve() / model_id / "weights" / "c1"
    assert paths.parse(f"tinker://{model_id}/sampler_weights/s.1") == paths.for_save(model_id, "sampler_weights", "s.1")


@pytest.mark.parametrize("name", ["..", ".", "a/b", "", "a b", "x" * 129, "..\\x"])
def test_bad_checkpoint_names_are_refused(tmp_path, name):
    with pytest.raises(RequestError, match="path: expects a name of 1-128"):
        CheckpointPaths(tmp_path).for_save("sess-0123456789abcdef:train:0", "weights", name)


@pytest.mark.parametrize(
    "uri",
    [
        "file:///etc/passwd",
        "tinker://sess-0123456789abcdef:train:0/weights",
        "tinker://sess-0123456789abcdef:train:0/other/c1",
        "tinker://../weights/c1",
        "tinker://sess-0123456789abcdef:train:0/weights/../../x",
        "tinker://sess-0123456789abcdef:train:0/weights/..",
    ],
)
def test_malformed_tinker_paths_are_refused(tmp_path, uri):
    with pytest.raises(RequestError, match="path: "):
        CheckpointPaths(tmp_path).parse(uri)


def test_a_path_of_the_wrong_kind_or_never_saved_is_refused(tmp_path):
    paths = CheckpointPaths(tmp_path)
    uri = "tinker://sess-0123456789abcdef:train:0/sampler_weights/s1"
    with pytest.raises(RequestError, match="expects a weights checkpoint"):
        paths.parse(uri, kinds=("weights",))
    with pytest.raises(NotFound, match="no checkpoint"):
        paths.existing(uri)
    paths.parse(uri).path.mkdir(parents=True)
    assert paths.existing(uri).name == "s1"


def test_a_symlink_under_the_root_cannot_lead_out_of_it(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (root / "sess-0123456789abcdef:train:0").mkdir(parents=True)
    (root / "sess-0123456789abcdef:train:0" / "weights").symlink_to(outside)
    with pytest.raises(RequestError, match="resolves outside the checkpoint root"):
        CheckpointPaths(root).parse("tinker://sess-0123456789abcdef:train:0/weights/c1")


def test_base_models_are_the_operators_checkpoints_and_the_tiny_families(tmp_path):
    models = BaseModels({"my-model": tmp_path})
    assert models.get("my-model").path == tmp_path
    tiny = models.get("tiny-qwen3")
    assert (tiny.path, tiny.family) == (None, "qwen3")
    assert models.names() == ["my-model", *(f"tiny-{f}" for f in FAMILY_CHOICES)]
    with pytest.raises(RequestError, match="base_model: expects one of .* got 'tiny-qwen'. Did you mean 'tiny-qwen3'"):
        models.get("tiny-qwen")
    with pytest.raises(RequestError, match="base_model: expects one of my-model, got 'tiny-char'"):
        BaseModels({"my-model": tmp_path}, allow_tiny=False).get("tiny-char")
