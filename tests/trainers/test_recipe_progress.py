"""What `train` and `sft` print to a log: progress lines that end at n == total, counts that agree with nouns."""

import json

from areal_agents.cli import main

COMMON = """
env: {id: areal_agents/Arithmetic-v0, kwargs: {digits: 1, max_turns: 1}}
eval: {num_problems: 1, env_kwargs: {split: test}}
"""


def write_configs(tmp_path, tiny_dir):
    data = tmp_path / "sft.jsonl"
    messages = [
        [{"role": "user", "content": f"{a}+1="}, {"role": "assistant", "content": str(a + 1)}] for a in range(8)
    ]
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in messages))
    sft = tmp_path / "sft.yaml"
    sft.write_text(
        f"run_dir: {tmp_path / 'sft'}\nmodel: {{path: {tiny_dir}}}\ndata: {data}\nsteps: 3\nbatch_size: 2\n"
        f"max_new_tokens: 2\n{COMMON}"
    )
    rl = tmp_path / "rl.yaml"
    rl.write_text(
        f"run_dir: {tmp_path / 'rl'}\nmodel: {{path: {tiny_dir}}}\nsteps: 3\n"
        "rollout: {batch_size: 2, group_size: 2, max_new_tokens: 2}\n"
        f"ppo: {{filter_zero_variance_groups: false}}\n{COMMON}"
    )
    return sft, rl


def progress_lines(err: str, desc: str) -> list[str]:
    assert "\r" not in err  # captured output is not a terminal: lines, no carriage returns
    return [line for line in err.splitlines() if line.startswith(f"{desc}: ")]


def test_a_short_rl_run_logs_its_last_step_and_a_resume_counts_from_its_checkpoint(tmp_path, tiny_dir, capsys):
    _, rl = write_configs(tmp_path, tiny_dir)
    assert main(["train", str(rl)]) == 0
    out, err = capsys.readouterr()
    assert progress_lines(err, "rl")[-1].startswith("rl: 3/3 [")  # was 2/3: the last step left by `break`
    assert "(1 problem)" in out and "1 problem)" in out.split("after RL")[1] and "3 steps in" in out

    assert main(["train", str(rl), "steps=4", "eval.every=2", "--resume"]) == 0
    out, err = capsys.readouterr()
    lines = progress_lines(err, "rl")
    assert lines[-1].startswith("rl: 4/4 [")  # steps 1-3 were done before: not 1/1
    assert "\n1 step (step 4) in " in out  # what this invocation trained, not the run's 4 steps
    summary = json.loads((tmp_path / "rl" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["steps_this_run"] == 1
    # the first invocation's points (before, and its end at step 3) kept; step 4 is the last: evaluated once
    assert [step for step, _ in summary["accuracy_curve"]] == [0, 3, 4]
    assert "held-out greedy accuracy by step: 0: " in out


def test_a_short_sft_run_logs_its_last_step(tmp_path, tiny_dir, capsys):
    sft, _ = write_configs(tmp_path, tiny_dir)
    assert main(["sft", str(sft)]) == 0
    out, err = capsys.readouterr()
    assert progress_lines(err, "sft")[-1].startswith("sft: 3/3 [")
    assert out.count("(1 problem)") == 2  # before and after SFT
