"""Chaos for training: a synchronous run (max_staleness 0) is SIGINTed, SIGKILLed and resumed in a loop
(seeded interruption points); it ends with a balanced ledger, every step once, and the data order of a
run that never stopped. Replay with ``CHAOS_SEED=N``."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from chaos_fuzz import report

SEED = int(os.environ.get("CHAOS_SEED", "0"))
STEPS = 8
pytestmark = pytest.mark.slow


def write_config(tmp_path, tiny_dir):
    config = tmp_path / "rl.yaml"
    config.write_text(
        f"model: {{path: {tiny_dir}}}\nsteps: {STEPS}\nsave_every: 1\nkeep_checkpoints: 2\n"
        "env: {id: areal_agents/Arithmetic-v0, kwargs: {digits: 1, max_turns: 2}}\n"
        "eval: {num_problems: 4, env_kwargs: {split: test}}\n"
        "rollout: {batch_size: 4, group_size: 4, max_new_tokens: 4, max_staleness: 0}\n"
        "ppo: {filter_zero_variance_groups: false}\n"
    )
    return config


def train(config, run_dir, *extra):
    return [
        sys.executable,
        "-m",
        "areal_agents.cli",
        "train",
        str(config),
        f"run_dir={run_dir}",
        "--no-progress",
        *extra,
    ]


def steps_logged(run_dir):
    """Step numbers in data_order.jsonl, in file order (a step logged twice shows up twice)."""
    path = run_dir / "data_order.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def interrupt_at(proc, run_dir, step, sig):
    """Send ``sig`` once ``step`` is logged (or at once if the run ends first)."""
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline and step not in steps_logged(run_dir):
        time.sleep(0.02)
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=120)


def test_interrupted_and_resumed_in_a_loop_ends_like_an_uninterrupted_run(tmp_path, tiny_dir):
    rng = random.Random(SEED)
    config = write_config(tmp_path, tiny_dir)
    reference = subprocess.run(train(config, tmp_path / "ref"), capture_output=True, text=True)
    assert reference.returncode == 0, reference.stderr

    run = tmp_path / "chaos"
    plan = sorted(rng.sample(range(2, STEPS), 3))  # steps at which an interruption lands
    signals = [rng.choice([signal.SIGINT, signal.SIGKILL, signal.SIGTERM]) for _ in plan]
    codes = []
    for step, sig in zip(plan, signals):
        resume = ["--resume"] if (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir()) else []
        proc = subprocess.Popen(train(config, run, *resume), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        codes.append(interrupt_at(proc, run, step, sig))
    final = subprocess.run(train(config, run, "--resume"), capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    for code, sig in zip(codes, signals):
        assert code in {signal.SIGINT: (130,), signal.SIGTERM: (143,), signal.SIGKILL: (-9,)}[sig]

    logged = steps_logged(run)
    lost = sorted(set(range(1, STEPS + 1)) - set(logged))
    report(
        f"chaos train (seed {SEED}): interrupted at steps {plan} by {[s.name for s in signals]}, exit codes "
        f"{codes}; steps lost: {len(lost)}, duplicated: {len(logged) - len(set(logged))}"
    )
    assert sorted(logged) == list(range(1, STEPS + 1)), f"every step once: {logged}"

    def order(path):
        return {
            row["step"]: row["prompts"] for row in map(json.loads, (path / "data_order.jsonl").read_text().splitlines())
        }

    assert order(run) == order(tmp_path / "ref")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine_version"] == STEPS and summary["episodes"]["running"] == 0
