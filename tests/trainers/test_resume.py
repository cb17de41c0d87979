"""`train --resume`: redone steps replace their earlier records, a changed config is named and refused
unless it changes only the run's length, checkpointing, evaluation or logging (or --allow-config-change), a
run of two FSDP2 ranks resumes into the optimizer state of the run that never stopped, and a checkpoint
records where the run stands in its prompts (consumed, in flight) with a ledger that balances across it."""

import io
import json
import shutil

import pytest
import torch
from rl_configs import write_rl_config

from areal_agents.cli import main
from areal_agents.config import TrainConfig, config_diff, config_to_dict, load_config
from areal_agents.models import load_model
from areal_agents.rollout.controller import DataCursor
from areal_agents.rollout.episodes import RolloutLedger
from areal_agents.trainers.resume import FREE_KEYS, forget_after
from areal_agents.trainers.run_state import RunState


def scalar_steps(run, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return [e.step for e in EventAccumulator(str(run / "tensorboard")).Reload().Scalars(tag)]


def test_redone_steps_replace_their_records(tmp_path, tiny_dir, capsys):
    """A run trained 4 steps but its last checkpoint is step 2 (as after a kill): the resume redoes step 3
    (and stops there: steps and dump_trajectories may change freely); data order, trajectory dumps and
    TensorBoard hold each step once, and the final evaluation is the resumed run's. It also changes ppo.lr,
    allowed by --allow-config-change: named, saved as the run's config, and trained with."""
    rl = write_rl_config(tmp_path, tiny_dir)
    run = tmp_path / "rl"
    args = ["train", str(rl), "save_every=2", "keep_checkpoints=0", "--no-progress"]
    assert main([*args, "steps=4", "rollout.dump_trajectories=true"]) == 0
    shutil.rmtree(run / "checkpoints" / "step_4")
    assert main([*args, "steps=3", "ppo.lr=2e-4", "--resume", "--allow-config-change"]) == 0
    assert "with config changes (--allow-config-change): ppo.lr: 0.0001 -> 0.0002" in capsys.readouterr().out
    assert json.loads((run / "config.json").read_text())["ppo"]["lr"] == 2e-4
    state = torch.load(run / "checkpoints" / "step_3" / "trainer_state.pt", weights_only=False)
    assert state["optimizer"]["param_groups"][0]["lr"] == 2e-4 and state["scheduler"]["base_lrs"] == [2e-4]
    rows = [json.loads(line) for line in (run / "data_order.jsonl").read_text().splitlines()]
    assert rows == [{"step": k + 1, "prompts": list(range(4 * k, 4 * k + 4))} for k in range(3)]
    assert sorted(p.name for p in (run / "trajectories").iterdir()) == ["step_1.jsonl", "step_2.jsonl"]
    assert scalar_steps(run, "rollout/reward_mean") == scalar_steps(run, "engine/version") == [1, 2, 3]
    assert scalar_steps(run, "eval/accuracy") == [0, 3]


def _assert_same_optimizer(got: dict, want: dict, what: str) -> None:
    """Every parameter's AdamW state: its step count exactly, its moments to float noise (the ranks' sums may
    add in another order from run to run), and the groups' rates."""
    assert got["param_groups"] == want["param_groups"], what
    assert got["state"].keys() == want["state"].keys(), what
    for i, s in want["state"].items():
        assert torch.equal(got["state"][i]["step"], s["step"]), f"{what}: parameter {i}'s step"
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["state"][i][key], s[key], rtol=1e-4, atol=1e-8, msg=f"{what} {i} {key}")


@pytest.mark.slow
def test_a_two_rank_run_resumed_ends_as_the_run_that_never_stopped(tmp_path, tiny_dir):
    """ppo.nproc_per_node=2: a run of 3 steps stopped after step 1 and resumed ends with the optimizer state
    (every parameter's step, exp_avg and exp_avg_sq; the critic's too), the schedule and the weights of the same
    run uninterrupted. The rollouts are the same in both: synchronous (max_staleness 0), every request sampled
    from one seed. The untrained tiny model scores 0, so GAE with a reward bias (returns 1, values 0) and no
    whitening gives every token an advantage: a gradient to step with."""
    rl = write_rl_config(tmp_path, tiny_dir)
    args = [
        "train", str(rl), "ppo.nproc_per_node=2", "rollout.max_staleness=0",
        "rollout.agent=seeded_agent:SeededChatAgent", "ppo.advantage=gae", "ppo.reward_bias=1",
        "ppo.whiten_advantages=false", "save_every=1", "keep_checkpoints=0", "eval.num_problems=2", "--no-progress",
    ]  # fmt: skip
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main([*args, f"run_dir={whole}", "steps=3"]) == 0
    assert main([*args, f"run_dir={cut}", "steps=1"]) == 0
    assert main([*args, f"run_dir={cut}", "steps=3", "--resume"]) == 0

    for step in (2, 3):
        ckpt = f"checkpoints/step_{step}"
        want = torch.load(whole / ckpt / "trainer_state.pt", weights_only=False)
        got = torch.load(cut / ckpt / "trainer_state.pt", weights_only=False)
        assert any(s["exp_avg"].abs().max() > 0 for s in want["optimizer"]["state"].values())  # it trained
        assert {float(s["step"]) for s in want["optimizer"]["state"].values()} == {step}  # one step a step
        _assert_same_optimizer(got["optimizer"], want["optimizer"], f"step {step}: policy")
        _assert_same_optimizer(got["critic_optimizer"], want["critic_optimizer"], f"step {step}: critic")
        assert got["scheduler"] == want["scheduler"]
        weights = {f"model.{k}": v for k, v in load_model(cut / ckpt / "model").state_dict().items()}
        expected = {f"model.{k}": v for k, v in load_model(whole / ckpt / "model").state_dict().items()}
        weights |= {f"critic.{k}": v for k, v in got["critic"].items()}
        expected |= {f"critic.{k}": v for k, v in want["critic"].items()}
        assert weights.keys() == expected.keys()
        for k, w in expected.items():
            torch.testing.assert_close(weights[k], w, rtol=1e-4, atol=1e-7, msg=f"step {step}: {k}")


def test_a_resume_with_a_changed_config_names_the_keys_and_needs_allow_config_change(tmp_path, tiny_dir, capsys):
    """Checked before anything loads: the run's saved config and a checkpoint are all it needs here."""
    rl = write_rl_config(tmp_path, tiny_dir)
    run = tmp_path / "rl"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(config_to_dict(load_config(TrainConfig, rl))))
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    torch.save({}, run / "checkpoints" / "step_1" / "trainer_state.pt")

    assert main(["train", str(rl), "ppo.lr=1e-3", "rollout.batch_size=2", "seed=7", "--resume"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "ppo.lr: 0.0001 -> 0.001; rollout.batch_size: 4 -> 2; seed: 1 -> 7" in err
    assert "--allow-config-change" in err


def test_config_diff_names_dotted_keys_and_skips_the_free_ones():
    saved = config_to_dict(TrainConfig(steps=10))
    new = config_to_dict(TrainConfig(steps=20, save_every=5, keep_checkpoints=1, max_train_minutes=3.0))
    new["eval"]["num_problems"] = 5
    new["rollout"]["dump_trajectories"] = True
    assert config_diff(saved, new, ignore=FREE_KEYS) == []  # all free

    new["env"]["kwargs"] = {"digits": 2}
    new["engine"]["backend"] = "serve-model"
    new["model"]["path"] = "other"
    assert config_diff(saved, new, ignore=FREE_KEYS) == [
        'engine.backend: "hf" -> "serve-model"',
        "env.kwargs.digits: (absent) -> 2",
        'model.path: "" -> "other"',
    ]


def test_a_key_newer_than_the_saved_config_counts_only_when_set_away_from_its_default():
    defaults = config_to_dict(TrainConfig())
    saved = config_to_dict(TrainConfig())
    del saved["ppo"]["stream_updates"]  # a run saved before the key existed
    assert config_diff(saved, config_to_dict(TrainConfig()), ignore=FREE_KEYS, defaults=defaults) == []
    changed = config_to_dict(TrainConfig())
    changed["ppo"]["stream_updates"] = False
    assert config_diff(saved, changed, ignore=FREE_KEYS, defaults=defaults) == ["ppo.stream_updates: true -> false"]


def test_with_config_rates_changes_the_base_rate_and_keeps_the_schedule_and_moments():
    from areal_agents.trainers.optim import make_optimizer
    from areal_agents.trainers.resume import with_config_rates

    def trained(lr):
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 2)
        optimizer, scheduler = make_optimizer(model, lr, 0.0, 4, "linear", 10)
        for _ in range(2):  # warm-up factor now 3/4
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
            scheduler.step()
        return model, optimizer, scheduler

    model, optimizer, scheduler = trained(1e-4)
    saved = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    assert with_config_rates(saved, 1e-4, 0.0, 1e-4) == saved  # unchanged: bit for bit

    _, optimizer, scheduler = trained(1e-3)  # a fresh run's objects, as a resume builds them
    state = with_config_rates(saved, 1e-3, 0.1, 1e-4)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(1e-3 * 3 / 4) and group["weight_decay"] == 0.1  # 3/4: step 2 of warm-up 4
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], saved["optimizer"]["state"][0]["exp_avg"])
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # warm-up done: the new base rate


@pytest.mark.parametrize("torn", [False, True])
def test_forget_after_drops_later_rows_and_dumps(tmp_path, torn):
    rows = [json.dumps({"step": k, "prompts": [k]}) + "\n" for k in (1, 2, 3)]
    (tmp_path / "data_order.jsonl").write_text("".join(rows) + ('{"step": 4, "pro' if torn else ""))
    for dumps in ("trajectories", "eval_samples"):
        (tmp_path / dumps).mkdir()
        for k in (1, 2, 3):
            (tmp_path / dumps / f"step_{k}.jsonl").write_text("{}\n")
    forget_after(tmp_path, 2)
    assert (tmp_path / "data_order.jsonl").read_text() == "".join(rows[:2])
    for dumps in ("trajectories", "eval_samples"):
        assert sorted(p.name for p in (tmp_path / dumps).iterdir()) == ["step_1.jsonl", "step_2.jsonl"]


def test_a_checkpoint_records_the_cursor_and_a_resume_cancels_what_was_in_flight():
    """The cursor goes through a checkpoint whole; the episodes in flight at it (4 running, 5 ended well in
    groups not yet trained) count as cancelled, since their groups run again: accepted stays what was trained."""
    run = RunState.restore(1, None)
    run.ledger = RolloutLedger(submitted=35, accepted=30, failed=1)  # 4 running
    cursor = DataCursor(8, (9, 11), {8: 2, 10: 2, 12: 3}, in_flight_accepted=5)
    state = torch.load(_saved(run.snapshot(cursor, version=3) | {"step": 3}), weights_only=True)
    resumed = RunState.restore(1, state)
    assert resumed.first_step == 4 and resumed.data == cursor
    assert resumed.ledger == RolloutLedger(submitted=35, accepted=25, failed=1, cancelled=9)
    assert resumed.ledger.running == 0


def test_a_checkpoint_from_before_the_cursor_resumes_from_its_position():
    """No ``consumed`` or ``in_flight`` keys (an older checkpoint): resume from ``data_position`` as before,
    the running episodes taken out of the submitted count."""
    run = RunState.restore(1, None)
    run.ledger = RolloutLedger(submitted=20, accepted=16, failed=1)  # 3 running
    state = run.snapshot(12, version=3) | {"step": 3}
    for key in ("consumed", "in_flight", "in_flight_accepted"):
        del state[key]
    resumed = RunState.restore(1, state)
    assert resumed.data == DataCursor(12)
    assert resumed.ledger == RolloutLedger(submitted=17, accepted=16, failed=1) and resumed.ledger.running == 0


def _saved(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer
