"""Eval results are tied to what produced them: a rerun resumes only the same model, engine, settings and
dataset; another checkpoint goes to a new default directory (or stops, with --out) instead of reusing
the first one's samples. Out-of-range numbers and a model path that is a file are one-line errors."""

import json

import pytest

from areal_agents.cli import main
from areal_agents.eval.provenance import RunMismatch, claim, model_digest
from areal_agents.models import save_tiny_model

EVAL = ["eval", "--dataset", "aime24", "--num-problems", "3", "--max-new-tokens", "4", "--no-progress"]


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A second checkpoint: the same architecture, other weights (checkpoint B)."""
    return save_tiny_model(tmp_path_factory.mktemp("b"), seed=1, hidden_size=64, num_layers=2, intermediate_size=128)


def samples(out):
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


@pytest.mark.process
def test_checkpoint_b_after_a_gets_its_own_default_directory(tmp_path, monkeypatch, tiny_dir, other_model):
    monkeypatch.chdir(tmp_path)
    assert main([*EVAL, "--model", str(tiny_dir), "--n-samples", "1"]) == 0
    first = tmp_path / "runs" / "eval" / "aime24"
    assert main([*EVAL, "--model", str(other_model), "--n-samples", "1"]) == 0
    second = tmp_path / "runs" / "eval" / "aime24-2"
    assert {s["run"]["model"] for s in samples(first)} == {str(tiny_dir)}
    assert {s["run"]["model"] for s in samples(second)} == {str(other_model)} and len(samples(second)) == 3
    summary = json.loads((second / "summary.json").read_text())
    assert summary["out"] == "runs/eval/aime24-2" and summary["run"]["model_hash"] == model_digest(other_model)
    # checkpoint A again: its own directory, resumed, nothing generated again
    assert main([*EVAL, "--model", str(tiny_dir), "--n-samples", "1"]) == 0
    assert len(samples(first)) == 3 and not (tmp_path / "runs" / "eval" / "aime24-3").exists()


@pytest.mark.process
def test_an_explicit_out_of_another_run_stops_and_says_what_differs(tmp_path, tiny_dir, other_model, capsys):
    out = str(tmp_path / "out")
    assert main([*EVAL, "--model", str(tiny_dir), "--out", out]) == 0
    assert main([*EVAL, "--model", str(other_model), "--out", out]) == 2
    err = capsys.readouterr().err
    assert "holds an eval of something else" in err and "model_hash" in err and "model:" in err
    assert main([*EVAL, "--model", str(tiny_dir), "--out", out, "--temperature", "0.9"]) == 2
    err = capsys.readouterr().err
    assert "sampling.temperature: 0.6 -> 0.9" in err and "--overwrite" in err
    assert {s["run"]["model"] for s in samples(tmp_path / "out")} == {str(tiny_dir)}  # refused: untouched


@pytest.mark.process
def test_overwrite_replaces_another_runs_samples_in_an_explicit_out(tmp_path, tiny_dir, other_model):
    out = tmp_path / "out"
    assert main([*EVAL, "--model", str(tiny_dir), "--out", str(out)]) == 0
    count = len(samples(out))
    (out / "failures.log").write_text("the old run's\n")
    assert main([*EVAL, "--model", str(other_model), "--out", str(out), "--overwrite"]) == 0
    assert {s["run"]["model"] for s in samples(out)} == {str(other_model)} and len(samples(out)) == count
    assert json.loads((out / "run.json").read_text())["model"] == str(other_model)
    assert not (out / "failures.log").exists() or "old run" not in (out / "failures.log").read_text()


@pytest.mark.process
def test_more_samples_of_the_same_run_resume_and_add(tmp_path, tiny_dir):
    out = tmp_path / "out"
    assert main([*EVAL, "--model", str(tiny_dir), "--out", str(out), "--n-samples", "1"]) == 0
    first = samples(out)
    assert main([*EVAL, "--model", str(tiny_dir), "--out", str(out), "--n-samples", "2"]) == 0
    assert samples(out)[:3] == first and len(samples(out)) == 6
    stamp = samples(out)[0]["run"]
    assert set(stamp) == {"model", "model_hash", "engine", "sampling", "dataset_hash"}
    assert stamp["engine"] == {"backend": "hf", "urls": []} and stamp["sampling"]["max_new_tokens"] == 4


def test_samples_without_a_record_are_not_resumed(tmp_path):
    (tmp_path / "samples.jsonl").write_text('{"index": 0, "sample": 0}\n')
    with pytest.raises(RunMismatch, match="unrecorded run"):
        claim(tmp_path, {"model": "m"})


def test_model_digest_follows_the_weights_not_the_path(tmp_path, tiny_dir):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    assert model_digest(copy) == model_digest(tiny_dir)
    (copy / "README.md").write_text("notes do not change what the model computes")
    assert model_digest(copy) == model_digest(tiny_dir)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert model_digest(copy) != model_digest(tiny_dir)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--n-samples", "-3"], "--n-samples must be >= 1, got -3"),
        (["--concurrency", "0"], "--concurrency must be >= 1, got 0"),
        (["--num-problems", "0"], "--num-problems must be >= 1, got 0"),
        (["--top-p", "1.5"], "--top-p in (0, 1]"),
    ],
)
def test_out_of_range_numbers_are_one_line_errors(tmp_path, tiny_dir, capsys, flags, message):
    assert main([*EVAL, "--model", str(tiny_dir), "--out", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing written


def test_a_model_path_that_is_a_file_says_so(tmp_path, capsys):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    assert main([*EVAL, "--model", str(weights)]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
