"""The run's summary: the held-out curve in summary.json and printed, and the steps this invocation trained
(a resumed run's own, not the run's total); the curve a checkpoint carries into a resumed run."""

import json

import torch

from areal_agents.rollout.episodes import RolloutLedger
from areal_agents.trainers.run_state import RunState
from areal_agents.trainers.run_summary import format_curve, write_summary
from areal_agents.trainers.step_metrics import Totals


def summarize(tmp_path, steps, curve):
    return write_summary(
        tmp_path,
        accuracy={"before": curve[0][1], "after": curve[-1][1]},
        curve=curve,
        eval_problems=200,
        steps=steps,
        version=steps[1],
        wall=4.2,
        totals=Totals(trained_samples=100, train_seconds=1.0, generated_tokens=800, rollout_seconds=2.0),
        engine_reports=False,
        ledger=RolloutLedger(),
        retries=0,
        checkpoint=tmp_path / "checkpoints" / f"step_{steps[1]}",
        launcher_stats={},
    )


def test_a_fresh_run_prints_and_keeps_its_curve(tmp_path, capsys):
    curve = [(0, 0.68), (3, 0.795), (6, 0.83)]
    summary = summarize(tmp_path, (1, 6), curve)
    out = capsys.readouterr().out
    assert "held-out greedy accuracy by step: 0: 68.0% | 3: 79.5% | 6: 83.0%\n" in out
    assert "\n6 steps in 4 s | 100 trained samples/s" in out
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved == summary and saved["accuracy_curve"] == [[0, 0.68], [3, 0.795], [6, 0.83]]
    assert saved["steps"] == saved["steps_this_run"] == 6


def test_a_resumed_run_counts_its_own_steps(tmp_path, capsys):
    """Resumed from step 20 to 30: 10 steps ran here; the run's step count stays 30."""
    summary = summarize(tmp_path, (21, 30), [(0, 0.68), (20, 0.865), (30, 0.885)])
    assert "\n10 steps (21->30) in 4 s |" in capsys.readouterr().out
    assert summary["steps"] == 30 and summary["steps_this_run"] == 10

    summarize(tmp_path, (31, 31), [(0, 0.68), (30, 0.885), (31, 0.89)])
    assert "\n1 step (step 31) in 4 s |" in capsys.readouterr().out
    summarize(tmp_path, (31, 30), [(0, 0.68), (30, 0.885)])  # resumed at its last step: nothing to train
    assert "\n0 steps in 4 s |" in capsys.readouterr().out


def test_format_curve_reads_json_pairs_too():
    assert format_curve([[0, 0.5], [10, 0.755]]) == "0: 50.0% | 10: 75.5%"


def test_a_checkpoint_carries_the_curve_into_the_resumed_run():
    run = RunState.restore(1, None)
    for step, accuracy in ((0, 0.68), (3, 0.8), (6, 0.85)):
        run.record_accuracy(step, accuracy)
    assert run.accuracy_before == 0.68
    state = run.snapshot(data_position=96, version=6) | {"step": 6}
    state = torch.load(_saved(state), weights_only=True)  # as a checkpoint holds it
    resumed = RunState.restore(1, state)
    assert resumed.first_step == 7 and resumed.accuracy_curve == [(0, 0.68), (3, 0.8), (6, 0.85)]
    resumed.record_accuracy(6, 0.86)  # an evaluation of a step already on the curve replaces it
    assert resumed.accuracy_curve == [(0, 0.68), (3, 0.8), (6, 0.86)]


def test_a_checkpoint_from_before_the_curve_starts_it_at_the_accuracy_before():
    state = RunState.restore(1, None).snapshot(data_position=0, version=2) | {"step": 2, "accuracy_before": 0.5}
    del state["accuracy_curve"]
    assert RunState.restore(1, state).accuracy_curve == [(0, 0.5)]


def _saved(state):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer
