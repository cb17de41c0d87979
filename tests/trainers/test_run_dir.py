"""A run directory that holds a run is never written over silently: `train` needs --resume or --overwrite,
`sft` --overwrite; refused, nothing is written; --overwrite removes the old run's files and only those.
Also the start-up messages a user meets first: no arguments, a bad override, a relative model path."""

import asyncio
import io
import signal

import pytest

from areal_agents.cli import main
from areal_agents.errors import ConfigError
from areal_agents.progress import LineProgress
from areal_agents.trainers.interrupt import Interrupt, Interrupted
from areal_agents.trainers.resume import claim_run_dir


def old_run(run):
    """What a finished `train` leaves (its files, not real contents) and a file of the user's."""
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1").write_text("old")
    for name in ("config.json", "summary.json", "data_order.jsonl"):
        (run / name).write_text("{}")
    (run / "notes.txt").write_text("mine")
    return sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))


def write_config(tmp_path, run):
    config = tmp_path / "rl.yaml"
    config.write_text(f"run_dir: {run}\nmodel: {{path: {tmp_path / 'no-model'}}}\n")
    return config


def test_a_run_dir_that_holds_a_run_needs_resume_or_overwrite(tmp_path):
    run = tmp_path / "run"
    before = old_run(run)
    with pytest.raises(ConfigError) as e:
        claim_run_dir(run, "train")
    assert "holds a run (config.json, summary.json, checkpoints, ...)" in str(e.value)
    assert "--resume to continue it, --overwrite to start over" in str(e.value)
    with pytest.raises(ConfigError, match="pass --overwrite to replace it"):
        claim_run_dir(run, "sft")
    claim_run_dir(run, "train", resume=True)
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before  # nothing touched
    claim_run_dir(run, "train", overwrite=True)
    assert [p.name for p in run.iterdir()] == ["notes.txt"]  # the run's files gone, the user's kept


def test_an_empty_run_dir_or_a_start_that_failed_early_needs_no_flag(tmp_path):
    claim_run_dir(tmp_path / "absent", "train")
    (tmp_path / "failed").mkdir()
    (tmp_path / "failed" / "config.json").write_text("{}")  # written before an env check failed
    claim_run_dir(tmp_path / "failed", "sft")


@pytest.mark.parametrize("command", ["train", "sft"])
def test_the_cli_refuses_in_one_line_and_writes_nothing(tmp_path, capsys, command):
    run = tmp_path / "run"
    before = old_run(run)
    assert main([command, str(write_config(tmp_path, run)), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"run_dir {run} holds a run" in err and "--overwrite" in err
    assert ("--resume" in err) == (command == "train")
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before
    # --overwrite clears it, then the run starts (and stops here at the missing model)
    assert main([command, str(write_config(tmp_path, run)), "--overwrite", "--no-progress"]) == 2
    assert "model path does not exist" in capsys.readouterr().err or command == "sft"  # sft: no data first
    assert [p.name for p in run.iterdir()] == ["notes.txt"]


def test_resume_and_overwrite_together_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "rl.yaml", "--resume", "--overwrite"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "sft"])
def test_no_arguments_name_only_the_config(capsys, command):
    with pytest.raises(SystemExit):
        main([command])
    err = capsys.readouterr().err
    assert "the following arguments are required: config" in err and "overrides" not in err.splitlines()[-1]


def test_a_bad_override_is_named_once(tmp_path, capsys):
    config = write_config(tmp_path, tmp_path / "run")
    assert main(["train", str(config), "ppo.lr=1e-3", "steps=abc", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "config key 'steps' in override 'steps=abc': expects an integer, got 'abc'" in err
    assert "+ overrides" not in err


def test_a_relative_model_path_shows_where_it_was_looked_for(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rl.yaml").write_text("run_dir: run\nmodel: {path: runs/arith/sft/model}\n")
    assert main(["train", "rl.yaml", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"model path does not exist: runs/arith/sft/model (relative to the working directory: {tmp_path}/" in err


def test_a_stop_closes_the_progress_bar_before_its_messages():
    """The bar's last line comes before what the stop prints, not after (when the bar is collected)."""
    log = io.StringIO()
    bar = LineProgress(total=10, desc="rl", file=log, interval=3600)
    bar.update(3)

    async def save():
        log.write("stopped by SIGINT after step 3\n")

    interrupt = Interrupt()
    interrupt.signum, interrupt.on_stop = signal.SIGINT, save
    with pytest.raises(Interrupted):
        asyncio.run(interrupt.stop())
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("rl: 3/10") and lines[1] == "stopped by SIGINT after step 3", lines
