from pathlib import Path

import pytest

from areal_agents.config import TrainConfig, load_config
from areal_agents.errors import ConfigError


def write(tmp_path, text):
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_file_and_overrides_are_typed(tmp_path):
    p = write(tmp_path, "steps: 3\nppo:\n  lr: 1e-3\nenv:\n  kwargs: {digits: 3}\n")
    cfg = load_config(TrainConfig, p, ["ppo.eps_clip_higher=0.28", "rollout.group_size=4", "model.path=x"])
    assert cfg.steps == 3 and cfg.ppo.lr == 1e-3  # "1e-3" is a YAML 1.1 string; converted to float
    assert cfg.ppo.eps_clip_higher == 0.28 and cfg.rollout.group_size == 4
    assert cfg.env.kwargs == {"digits": 3} and cfg.model.path == "x"


def test_unknown_key_names_key_file_and_suggestion(tmp_path):
    p = write(tmp_path, "ppo:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, p)
    assert "'ppo.lrr'" in str(e.value) and str(p) in str(e.value) and "'ppo.lr'" in str(e.value)


def test_unknown_override_names_the_override(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.grop_size' in override .*group_size"):
        load_config(TrainConfig, write(tmp_path, "steps: 1\n"), ["rollout.grop_size=4"])


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(ConfigError, match=r"'rollout.batch_size' in .*cfg.yaml: expects an integer, got 'many'"):
        load_config(TrainConfig, write(tmp_path, "rollout:\n  batch_size: many\n"))
    with pytest.raises(ConfigError, match=r"'ppo.filter_zero_variance_groups'.*true or false"):
        load_config(TrainConfig, None, ["ppo.filter_zero_variance_groups=3"])


def test_choice_and_range_are_validated():
    with pytest.raises(ConfigError, match=r"'ppo.advantage'.*one of 'grpo', 'dr_grpo', 'rloo', 'gae'"):
        load_config(TrainConfig, None, ["ppo.advantage=ppo"])
    with pytest.raises(ConfigError, match=r"config key ppo.lr: expects a value > 0"):
        load_config(TrainConfig, None, ["ppo.lr=-1"])
    with pytest.raises(ConfigError, match=r"engine.prefix_cache_tokens: expects a value >= 0, got -1"):
        load_config(TrainConfig, None, ["engine.prefix_cache_tokens=-1"])
    with pytest.raises(ConfigError, match=r"'ppo.trainer'.*one of 'thread', 'process'"):
        load_config(TrainConfig, None, ["ppo.trainer=gpu"])
    with pytest.raises(ConfigError, match=r"engine.own_process: applies to the in-process hf engine"):
        load_config(TrainConfig, None, ["engine.backend=serve-model", "engine.own_process=true"])
    with pytest.raises(ConfigError, match=r"ppo.trainer: 'process' is for local runs"):
        load_config(TrainConfig, None, ["launcher=ray", "ppo.trainer=process"])
    with pytest.raises(ConfigError, match=r"max_concurrent_rollouts: expects at least group_size \(16\) episodes"):
        load_config(TrainConfig, None, ["rollout.group_size=16", "rollout.max_concurrent_rollouts=8"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(TrainConfig, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(TrainConfig, write(tmp_path, "steps: [1\n"))
    with pytest.raises(ConfigError, match="expects the form key.sub=value"):
        load_config(TrainConfig, None, ["steps"])


@pytest.mark.parametrize(
    "path", sorted(Path(__file__).parents[1].glob("examples/*/*.yaml")), ids=lambda p: p.parent.name + "/" + p.name
)
def test_example_configs_load_and_make_their_envs(path):
    """Every shipped recipe is a valid config; the toy tasks' envs (train and eval kwargs) can be made (math and
    code load their datasets from the Hugging Face hub, out of reach here)."""
    from areal_agents.config import SFTConfig  # noqa: PLC0415
    from areal_agents.envs import make_env  # noqa: PLC0415

    cfg = load_config(SFTConfig if path.name.startswith("sft") else TrainConfig, path)
    if path.parent.name in ("math", "code"):
        return
    make_env(cfg.env.id, **cfg.env.kwargs).reset(seed=0)
    make_env(cfg.env.id, **{**cfg.env.kwargs, **cfg.eval.env_kwargs}).reset(seed=0)


def test_in_process_weight_sharing_needs_a_synchronous_thread_trainer():
    ok = load_config(TrainConfig, None, ["engine.weight_sync=in_process"])
    assert ok.engine.weight_sync == "in_process"
    for bad in ("rollout.max_staleness=1", "ppo.trainer=process", "ppo.nproc_per_node=2", "engine.own_process=true"):
        with pytest.raises(ConfigError, match="engine.weight_sync: in_process .*max_staleness=0"):
            load_config(TrainConfig, None, ["engine.weight_sync=in_process", bad])
    with pytest.raises(ConfigError, match="weight_sync: disk applies to model servers"):
        load_config(TrainConfig, None, ["engine.weight_sync=disk"])
    with pytest.raises(ConfigError, match="ppo.nproc_per_node: for local runs"):
        load_config(TrainConfig, None, ["ppo.nproc_per_node=2", "launcher=ray"])


def test_a_fields_flag_parses_as_its_annotation_says_and_defaults_to_not_given():
    import argparse
    from dataclasses import dataclass
    from typing import Literal

    from areal_agents.config import config_field
    from areal_agents.config.flags import add_field_flag

    @dataclass
    class Opts:
        hub: bool = config_field("from the hub", default=False)
        url: list[str] = config_field("servers", default_factory=list)
        engine: Literal["hf", "vllm"] = config_field("the engine", default="hf")
        top_p: float | None = config_field("nucleus", default=None)
        note: str = config_field("100% free text", default="")
        table: dict[str, int] = config_field("no flag for this", default_factory=dict)

    parser = argparse.ArgumentParser()
    for name in ("hub", "url", "engine", "top_p", "note"):
        add_field_flag(parser, Opts, name)
    assert vars(parser.parse_args([])) == dict.fromkeys(("hub", "url", "engine", "top_p", "note"))
    given = parser.parse_args(["--no-hub", "--url", "a", "--url", "b", "--engine", "vllm", "--top-p", "0.9"])
    assert (given.hub, given.url, given.engine, given.top_p) == (False, ["a", "b"], "vllm", 0.9)
    assert parser.parse_args(["--hub"]).hub is True
    text = parser.format_help()
    assert "the engine (default hf)" in text and "servers (repeatable)" in text and "100% free text" in text
    with pytest.raises(SystemExit):
        parser.parse_args(["--engine", "sglang"])  # not one of the Literal's choices
    with pytest.raises(TypeError, match=r"Opts.table: no command-line flag"):
        add_field_flag(parser, Opts, "table")
    with pytest.raises(ValueError, match="expects a field of Opts, got 'nope'"):
        add_field_flag(parser, Opts, "nope")


def test_config_diff_names_each_dotted_key_that_differs_as_json():
    from areal_agents.config import config_diff

    saved = {"model": "a", "sampling": {"temperature": 0.6, "stop": ["x"]}, "window": ["2024", "2025"], "seed": 0}
    new = {"model": "b", "sampling": {"temperature": 0.6, "stop": ["x", "y"]}, "window": ("2024", "2025"), "top": 1}
    assert config_diff(saved, new) == [  # sorted; a tuple is the list JSON gives back; a missing key is (absent)
        'model: "a" -> "b"',
        'sampling.stop: ["x"] -> ["x", "y"]',
        "seed: 0 -> (absent)",
        "top: (absent) -> 1",
    ]
    assert config_diff(saved, new, ignore=["model", "sampling"]) == ["seed: 0 -> (absent)", "top: (absent) -> 1"]
    assert config_diff({}, {"seed": 0, "top": 2}, defaults={"seed": 0, "top": 1}) == ["top: 1 -> 2"]  # old lacks


BROADCAST_TO_COLOCATED_SGLANG = ["engine.backend=sglang", "engine.weight_sync=broadcast"]


def test_a_cuda_trainer_broadcasting_to_colocated_sglang_is_refused_naming_engine_gpus():
    """NCCL refuses two ranks on one GPU: the trainer on cuda:0 and SGLang server 0, colocated, on GPU 0."""
    with pytest.raises(ConfigError, match=r"ppo.device=cuda: .*Duplicate GPU.*set engine.gpus .*weight_sync=disk"):
        load_config(TrainConfig, None, [*BROADCAST_TO_COLOCATED_SGLANG, "ppo.device=cuda"])
    fine = [
        ["engine.gpus=[1]"],  # disaggregated: the servers on other GPUs
        ["ppo.device=cpu"],  # a CPU trainer broadcasts over gloo
        ["ppo.device=auto"],  # known once resolved: the launcher checks it
        ["ppo.trainer=process"],  # the weights reach the driver on the CPU: gloo
        ["engine.urls=[http://10.0.0.1:30000]"],  # servers elsewhere: their GPUs are not known here
    ]
    for extra in fine:
        cuda = [] if any(e.startswith("ppo.device") for e in extra) else ["ppo.device=cuda"]
        load_config(TrainConfig, None, [*BROADCAST_TO_COLOCATED_SGLANG, *cuda, *extra])
    load_config(TrainConfig, None, ["engine.backend=serve-model", "engine.weight_sync=broadcast", "ppo.device=cuda"])


def test_eval_num_problems_zero_is_for_sft_alone():
    """sft may skip its held-out evaluation; train measures held-out accuracy, so 0 is refused by name."""
    from areal_agents.config import SFTConfig  # noqa: PLC0415

    assert load_config(SFTConfig, None, ["eval.num_problems=0"]).eval.num_problems == 0
    with pytest.raises(ConfigError, match="eval.num_problems: train measures held-out accuracy"):
        load_config(TrainConfig, None, ["eval.num_problems=0"])
    with pytest.raises(ConfigError, match="num_problems: expects a value >= 0"):
        load_config(SFTConfig, None, ["eval.num_problems=-1"])
