"""``launcher=ray`` mistakes stop the run at start-up with one line naming the keys (exit code 2)."""

import pytest

from areal_agents.cli import main

pytest.importorskip("ray")
RECIPE = "examples/arithmetic/rl.yaml"


def test_asking_for_more_cpus_than_the_cluster_has_names_the_keys(tiny_dir, tmp_path, capsys):
    args = [f"model.path={tiny_dir}", f"run_dir={tmp_path}", "launcher=ray", "ray.num_cpus=2", "ray.rollout_workers=3"]
    assert main(["train", RECIPE, *args, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the run asks for 6 CPUs (env servers 1, rollout workers 3, trainer ranks 1, model servers 1)" in err
    assert "the cluster has 2; lower ray.*_cpus" in err


def test_separate_policies_are_refused_on_ray(tiny_dir, tmp_path, capsys):
    args = [f"model.path={tiny_dir}", f"run_dir={tmp_path}", "launcher=ray", f"policies.a={tiny_dir}"]
    assert main(["train", RECIPE, *args, "--no-progress"]) == 2
    assert "launcher=ray: separate `policies` are not supported on Ray yet" in capsys.readouterr().err
