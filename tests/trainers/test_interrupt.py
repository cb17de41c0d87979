"""SIGINT/SIGTERM during `train`: the step in progress is abandoned, the last finished one is checkpointed,
the process exits 130/143, and `--resume` continues with every step recorded once."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from rl_configs import write_rl_config

from areal_agents.cli import main
from areal_agents.trainers.interrupt import Interrupt


def data_order(run):
    return [json.loads(line) for line in (run / "data_order.jsonl").read_text().splitlines()]


def scalar_steps(run, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return [e.step for e in EventAccumulator(str(run / "tensorboard")).Reload().Scalars(tag)]


def assert_checkpoint_holds_steps(ckpt, steps):
    """Exactly ``steps`` updates in it: one optimizer step, one weight push and one batch (4 prompts) each."""
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    assert state["step"] == state["version"] == state["scheduler"]["last_epoch"] == steps
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {steps}
    assert state["data_position"] == 4 * steps


# ---- the signal logic on its own -----------------------------------------------------------------


def test_a_signal_while_a_step_trains_waits_for_the_step_then_saves_and_exits_143():
    events = []

    async def train(interrupt):
        async def save():
            await asyncio.sleep(0)  # the recipe may still await while it saves
            events.append("saved")

        interrupt.on_stop = save
        try:
            interrupt.hold()  # the update
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.05)  # not cancelled: the update runs to its end
            events.append("trained")
            interrupt.release()
            events.append("next step")
        except asyncio.CancelledError:
            assert interrupt.caught()
            await interrupt.stop()

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with Interrupt() as interrupt, pytest.raises(SystemExit) as stop:
        interrupt.run(train(interrupt))
    assert stop.value.code == 143 and events == ["trained", "saved"]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # put back


def test_a_second_signal_stops_at_once_without_saving():
    events = []

    async def train(interrupt):
        async def save():
            events.append("saved")

        interrupt.on_stop = save
        try:
            interrupt.hold()
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(5)  # the second one cancels even a held step
            events.append("trained")
        except asyncio.CancelledError:
            assert interrupt.caught()
            await interrupt.stop()

    interrupt = Interrupt()
    with pytest.raises(KeyboardInterrupt):
        interrupt.run(train(interrupt))
    assert interrupt.forced and events == []


def test_a_signal_while_the_run_stops_its_servers_waits_for_the_stop_then_exits_as_signalled():
    """In the event loop (sessions, env servers) and after it (trainer processes, model servers): a signal
    cuts no stop short (it would leave a server or a session behind); it is acted on when the stop is done."""
    events = []

    async def train(interrupt):
        with interrupt.stopping():
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.05)  # not cancelled
            events.append("sessions closed")

    with Interrupt() as interrupt, pytest.raises(SystemExit) as stop:
        interrupt.run(train(interrupt))
    assert stop.value.code == 143 and events == ["sessions closed"]

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with Interrupt() as interrupt, pytest.raises(KeyboardInterrupt):
        with interrupt.stopping():
            os.kill(os.getpid(), signal.SIGINT)  # Python runs a handler at once: it would raise here
            events.append("servers stopped")
    assert events == ["sessions closed", "servers stopped"] and interrupt.name == "SIGINT"
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # put back


# ---- the recipe, in this process: where the signal lands is chosen -------------------------------


@pytest.mark.parametrize("during", ["rollout", "update"])
def test_sigint_in_a_rollout_abandons_the_step_and_in_an_update_finishes_it(tmp_path, tiny_dir, monkeypatch, during):
    """Step 3 is interrupted while it waits for rollouts (nothing of it trained; steps 1 and 2 were saved
    already, so no checkpoint is written) or while it trains (the update ends; step 3 is saved)."""
    from areal_agents.rollout.controller import RolloutController
    from areal_agents.trainers.policy import Policy

    run = tmp_path / "rl"
    cls, name = (RolloutController, "get_batch") if during == "rollout" else (Policy, "update")
    original, calls, saved_before = getattr(cls, name), [], []

    async def interrupted_at_the_third(self, *args):
        calls.append(name)
        if len(calls) == 3:
            saved_before.append((run / "checkpoints" / "step_2" / "trainer_state.pt").stat().st_ino)
            os.kill(os.getpid(), signal.SIGINT)
        return await original(self, *args)

    monkeypatch.setattr(cls, name, interrupted_at_the_third)
    rl = write_rl_config(tmp_path, tiny_dir)
    assert main(["train", str(rl), "steps=6", "save_every=1", "keep_checkpoints=0", "--no-progress"]) == 130
    assert not (run / "summary.json").exists()
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    if during == "rollout":
        assert kept == ["step_1", "step_2"] and [row["step"] for row in data_order(run)] == [1, 2]
        assert (run / "checkpoints" / "step_2" / "trainer_state.pt").stat().st_ino == saved_before[0]  # not rewritten
    else:
        assert kept == ["step_1", "step_2", "step_3"] and [row["step"] for row in data_order(run)] == [1, 2, 3]
        assert_checkpoint_holds_steps(run / "checkpoints" / "step_3", 3)
    assert scalar_steps(run, "rollout/reward_mean") == ([1, 2] if during == "rollout" else [1, 2, 3])


# ---- real signals to a real process --------------------------------------------------------------


@pytest.mark.process
@pytest.mark.parametrize("sig, code, extra", [("SIGINT", 130, []), ("SIGTERM", 143, ["rollout.max_staleness=1"])])
def test_a_signal_to_train_checkpoints_the_last_finished_step_and_resume_continues(
    tmp_path, tiny_dir, sig, code, extra
):
    """Signalled after 2 steps (no periodic checkpoints): a checkpoint of the last finished step, no update
    of the abandoned one in it, exit 128 + signal; `--resume` then runs each step once, in the data order
    of a run never stopped (prompts 4k..4k+3 at step k+1). SIGTERM: an async run with streamed updates,
    whose batches may take prompts out of order."""
    rl = write_rl_config(tmp_path, tiny_dir)
    run = tmp_path / "rl"
    cmd = [sys.executable, "-m", "areal_agents.cli", "train", str(rl), "steps=30", *extra, "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    order = run / "data_order.jsonl"
    while proc.poll() is None and time.monotonic() < deadline:
        if order.is_file() and len(order.read_text().splitlines()) >= 2:
            break
        time.sleep(0.02)
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    done = len(data_order(run))
    assert 2 <= done < 30 and f"stopped by {sig} after step {done}: checkpoint" in out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{done}"]
    assert_checkpoint_holds_steps(run / "checkpoints" / f"step_{done}", done)

    assert main(["train", str(rl), f"steps={done + 2}", *extra, "--resume", "--no-progress"]) == 0
    rows = data_order(run)
    assert [row["step"] for row in rows] == list(range(1, done + 3)) and all(len(row["prompts"]) == 4 for row in rows)
    if not extra:
        assert [row["prompts"] for row in rows] == [list(range(4 * k, 4 * k + 4)) for k in range(done + 2)]
    assert scalar_steps(run, "rollout/reward_mean") == list(range(1, done + 3))
    assert json.loads((run / "summary.json").read_text())["engine_version"] == done + 2
