"""``launcher=ray`` mistakes stop the run at start-up with one line naming the keys (exit code 2)."""

from importlib.util import find_spec

import pytest

from areal_agents.cli import main

pytestmark = [pytest.mark.process, pytest.mark.skipif(find_spec("ray") is None, reason="ray is not installed")]
RECIPE = "examples/arithmetic/rl.yaml"


def test_asking_for_more_cpus_than_the_cluster_has_names_the_keys(tiny_dir, tmp_path, capsys):
    args = [f"model.path={tiny_dir}", f"run_dir={tmp_path}", "launcher=ray", "ray.num_cpus=2", "ray.rollout_workers=3"]
    assert main(["train", RECIPE, *args, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the run asks for 6 CPUs (env servers 1, rollout workers 3, trainer ranks 1, model servers 1)" in err
    assert "the cluster has 2; lower ray.*_cpus" in err


def test_separate_full_weight_policies_are_refused_on_ray(tiny_dir, tmp_path, capsys):
    args = [f"model.path={tiny_dir}", f"run_dir={tmp_path}", "launcher=ray", f"policies.a={tiny_dir}"]
    assert main(["train", RECIPE, *args, "--no-progress"]) == 2
    assert "launcher=ray: separate full-weight `policies` (a) are not supported on Ray yet" in capsys.readouterr().err


def test_a_run_env_module_that_fails_to_import_stops_the_env_server_launch_in_one_line(tmp_path, monkeypatch):
    """The driver imports what the env servers will (env.module, the module of env.id) before any actor starts."""
    from areal_agents.cluster.env_servers import EnvServers
    from areal_agents.config import EnvConfig
    from areal_agents.errors import ArealAgentsError

    (tmp_path / "raising_run_envs.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ArealAgentsError, match=r"'raising_run_envs' failed while importing: RuntimeError: no GPU here"):
        EnvServers.launch(EnvConfig(id="raising_run_envs:Env"), 1, 1.0, 0, 5.0)
