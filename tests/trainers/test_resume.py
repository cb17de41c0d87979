"""`train --resume`: redone steps replace their earlier records, and a changed config is named and refused
unless it changes only the run's length, checkpointing, evaluation or logging (or --allow-config-change)."""

import json
import shutil

import pytest
import torch
from rl_configs import write_rl_config

from areal_agents.cli import main
from areal_agents.config import TrainConfig, config_to_dict, load_config
from areal_agents.trainers.resume import config_changes, forget_after


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


def test_config_changes_names_dotted_keys_and_skips_the_free_ones():
    saved = config_to_dict(TrainConfig(steps=10))
    new = config_to_dict(TrainConfig(steps=20, save_every=5, keep_checkpoints=1, max_train_minutes=3.0))
    new["eval"]["num_problems"] = 5
    new["rollout"]["dump_trajectories"] = True
    assert config_changes(saved, new) == []  # all free

    new["env"]["kwargs"] = {"digits": 2}
    new["engine"]["backend"] = "serve-model"
    new["model"]["path"] = "other"
    assert config_changes(saved, new) == [
        'engine.backend: "hf" -> "serve-model"',
        "env.kwargs.digits: (absent) -> 2",
        'model.path: "" -> "other"',
    ]


def test_a_key_newer_than_the_saved_config_counts_only_when_set_away_from_its_default():
    defaults = config_to_dict(TrainConfig())
    saved = config_to_dict(TrainConfig())
    del saved["ppo"]["stream_updates"]  # a run saved before the key existed
    assert config_changes(saved, config_to_dict(TrainConfig()), defaults) == []
    changed = config_to_dict(TrainConfig())
    changed["ppo"]["stream_updates"] = False
    assert config_changes(saved, changed, defaults) == ["ppo.stream_updates: true -> false"]


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
    (tmp_path / "trajectories").mkdir()
    for k in (1, 2, 3):
        (tmp_path / "trajectories" / f"step_{k}.jsonl").write_text("{}\n")
    forget_after(tmp_path, 2)
    assert (tmp_path / "data_order.jsonl").read_text() == "".join(rows[:2])
    assert sorted(p.name for p in (tmp_path / "trajectories").iterdir()) == ["step_1.jsonl", "step_2.jsonl"]
