"""Chaos for resume at any staleness: runs at ``rollout.max_staleness`` 0, 2 and 4 are SIGKILLed and
SIGTERMed at seeded moments (a random pause after a step, while episodes of later groups run: every third
prompt's episodes are slow, so younger groups overtake older ones) and resumed until done. From the data
order, the trajectory dumps and the last checkpoint: each prompt group was trained exactly once (none twice,
none below the final position skipped), each step's dump holds its groups' prompts, and the ledger balances
(``accepted`` is the episodes trained, nothing left running). Replay with ``CHAOS_SEED=N``."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from chaos_fuzz import report

from areal_agents.trainers.checkpoint import checkpoints

SEED = int(os.environ.get("CHAOS_SEED", "0"))
STEPS, BATCH, GROUP = 6, 4, 2
HERE = Path(__file__).parent
pytestmark = [pytest.mark.process, pytest.mark.slow]


@pytest.fixture(scope="module")
def config(tmp_path_factory, tiny_dir):
    """One config for the three staleness cases (set on the command line); the agent waits before episodes."""
    path = tmp_path_factory.mktemp("resume_exact") / "rl.yaml"
    path.write_text(
        f"model: {{path: {tiny_dir}}}\nsteps: {STEPS}\nsave_every: 1\nkeep_checkpoints: 2\n"
        "env: {id: areal_agents/Arithmetic-v0, kwargs: {digits: 1, max_turns: 2}}\n"
        "eval: {num_problems: 2, env_kwargs: {split: test}}\n"
        f"rollout: {{batch_size: {BATCH}, group_size: {GROUP}, max_new_tokens: 4, dump_trajectories: true,\n"
        "  agent: 'slow_prompts_agent:SlowPromptsAgent'}\n"
        "ppo: {filter_zero_variance_groups: false}\n"
    )
    return path


def start(config, run_dir, staleness, out):
    """The run, resumed when it has a checkpoint; its stdout (unbuffered) goes to ``out``."""
    resume = ["--resume"] if checkpoints(run_dir) else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    args = [sys.executable, "-m", "areal_agents.cli", "train", str(config), f"run_dir={run_dir}"]
    args += [f"rollout.max_staleness={staleness}", "--no-progress", *resume]
    with out.open("w") as f:
        return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env)


def steps_logged(run_dir):
    """The steps in ``data_order.jsonl`` (a row being written is not one yet)."""
    path = run_dir / "data_order.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.is_file() else []  # the text after the last newline: torn
    return [json.loads(line)["step"] for line in lines]


def kill_after(proc, run_dir, out, step, pause, sig):
    """Send ``sig`` ``pause`` seconds after ``step`` is logged by this process (after its start-up, which drops
    the rows a resume redoes); its exit code (0 if it ended first)."""
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if "accuracy before RL" in out.read_text() and step in steps_logged(run_dir):
            time.sleep(pause)
            break
        time.sleep(0.02)
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=120)


def prompt_of(group_id, seed):
    """The prompt index of a dumped group id (``g{index}-{seed_at(index)}``), checked against its seed."""
    index, prompt_seed = map(int, re.fullmatch(r"g(\d+)-(\d+)", group_id).groups())
    assert prompt_seed == int(np.random.default_rng([seed, index]).integers(0, 2**31 - 1)), group_id
    return index


@pytest.mark.parametrize("staleness", [0, 2, 4])
def test_killed_and_resumed_runs_train_each_group_exactly_once(tmp_path, config, staleness):
    rng = random.Random(f"{SEED}/{staleness}")
    run = tmp_path / "run"
    kills = rng.sample([signal.SIGKILL, signal.SIGTERM], 2)  # both, in a seeded order
    codes, outs = [], []
    for sig in kills:
        done = int(checkpoints(run)[-1].name.removeprefix("step_")) if checkpoints(run) else 0
        if done >= STEPS:
            break
        outs.append(tmp_path / f"out{len(outs)}.txt")
        proc = start(config, run, staleness, outs[-1])
        # after a step this process trains (past step 1: a first run must leave a checkpoint to resume from)
        step, pause = min(done + rng.randint(1, 2) + (done == 0), STEPS), rng.uniform(0.0, 0.6)
        codes.append(kill_after(proc, run, outs[-1], step, pause, sig))
        assert codes[-1] in {signal.SIGKILL: (-9, 0), signal.SIGTERM: (143, 0)}[sig], outs[-1].read_text()[-3000:]
    outs.append(tmp_path / "final.txt")
    final = start(config, run, staleness, outs[-1])
    assert final.wait(timeout=300) == 0, outs[-1].read_text()[-3000:]

    resumes = [m for out in outs for m in re.finditer(r"^prompts from prompt (\d+)(.*)$", out.read_text(), re.M)]
    in_flight = sum(int(m[1]) for r in resumes for m in re.finditer(r"(\d+) groups? in flight", r[2]))
    ahead = sum(int(m[1]) for r in resumes for m in re.finditer(r"(\d+) consumed ahead", r[2]))

    rows = [json.loads(line) for line in (run / "data_order.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows) == list(range(1, STEPS + 1)), rows  # every step once
    trained = [i for r in rows for i in r["prompts"]]
    state = torch.load(checkpoints(run)[-1] / "trainer_state.pt", weights_only=False)
    position, consumed = state["data_position"], state["consumed"]
    twice = len(trained) - len(set(trained))
    skipped = sorted(set(range(position)) - set(trained))

    seed = json.loads((run / "config.json").read_text())["seed"]
    episodes, mismatched = [], []
    for r in rows:  # each step's dump: its groups' trajectories, every episode of each group
        dumped = [json.loads(x) for x in (run / "trajectories" / f"step_{r['step']}.jsonl").read_text().splitlines()]
        if sorted({prompt_of(t["group_id"], seed) for t in dumped}) != sorted(r["prompts"]):
            mismatched.append(r["step"])
        episodes += sorted({t["episode_id"] for t in dumped})
    ledger = json.loads((run / "summary.json").read_text())["episodes"]
    ended = sum(ledger[k] for k in ("accepted", "rejected", "failed", "env_failed", "engine_failed", "worker_failed"))

    report(
        f"resume chaos (seed {SEED}) max_staleness={staleness}: {[s.name for s in kills[: len(codes)]]} -> exit "
        f"codes {codes}; {len(resumes)} resumes, {in_flight} groups in flight at them, {ahead} consumed ahead of "
        f"the position; trained twice: {twice}, skipped: {len(skipped)}; ledger: {ledger['accepted']} accepted, "
        f"{len(episodes)} episodes trained, {ledger['cancelled']} cancelled, {ledger['running']} running"
    )
    assert twice == 0 and skipped == [], (trained, position)
    assert mismatched == [] and len(episodes) == len(set(episodes)), mismatched  # dumps agree with the order
    assert set(trained) == set(range(position)) | set(consumed)  # nothing consumed but what was trained
    assert ledger["accepted"] == len(episodes) == STEPS * BATCH * GROUP and ledger["running"] == 0  # whole groups
    assert ledger["submitted"] == ended + ledger["cancelled"]
    assert len(resumes) == len(codes)  # each kill was resumed from a checkpoint
    if staleness:
        assert in_flight > 0  # resumes ran groups that were in flight at the kill
