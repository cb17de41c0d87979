"""Where eval's problems come from (any env: dataset rows or reset seeds, never the env's insides), the
finish reason taken from the engine's stop_reason, and the typed options of the eval command."""

import asyncio
import json

import pytest

from areal_agents.config import load_config
from areal_agents.data.base import raw_rows
from areal_agents.engines.base import InferenceEngine
from areal_agents.envs.runtime.pool import LocalEnvPool
from areal_agents.errors import ConfigError, RunHalted
from areal_agents.eval.options import EvalOptions, with_flags
from areal_agents.eval.problems import AtProblem, load_problems
from areal_agents.eval.runner import eval_settings, evaluate_dataset
from areal_agents.types import GenResponse


class PlainEnv:
    """An `AsyncEnv` that is no gymnasium env at all (no ``unwrapped``): seed s asks for the digit s % 10."""

    def __init__(self):
        self.seeds = []

    async def areset(self, seed=None, options=None):
        self.seeds.append(seed)
        self.digit = str((seed or 0) % 10)
        return f"Say {self.digit}", {}

    async def astep(self, action):
        return "", float(action.strip() == self.digit), True, False, {}

    async def aclose(self):
        pass


def test_an_env_without_a_dataset_is_evaluated_on_reset_seeds():
    made = []
    problems = asyncio.run(load_problems({}, lambda: made.append(PlainEnv()) or made[-1], num_problems=3))
    assert [(p.number, p.problem_id, p.seed, p.index) for p in problems.problems] == [
        (0, "seed0", 0, None),
        (1, "seed1", 1, None),
        (2, "seed2", 2, None),
    ]
    assert problems.dataset_hash is None and problems.notes == []
    env = AtProblem(PlainEnv(), problems.problems[2])
    assert asyncio.run(env.areset(seed=99))[0] == "Say 2"  # the problem's seed, not the sample's


def test_an_env_that_counts_its_own_problems_is_evaluated_on_their_indexes():
    # Math-v0 with its default dataset names none in its kwargs; its reset info says how many problems it
    # holds (num_problems), so eval runs indexes 0..n-1 without --num-problems and without looking inside it
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(3)]
    pool = LocalEnvPool("inline")
    make = lambda: pool.make("areal_agents.envs.dataset_env:DatasetEnv", rows=rows)  # noqa: E731
    problems = asyncio.run(load_problems({}, make))
    assert [(p.number, p.index, p.seed) for p in problems.problems] == [(0, 0, None), (1, 1, None), (2, 2, None)]
    two = asyncio.run(load_problems({}, make, num_problems=2))
    assert [p.index for p in two.problems] == [0, 1]
    env = AtProblem(make(), problems.problems[1])
    assert asyncio.run(env.areset(seed=5))[0] == "q1"


def test_an_env_naming_a_dataset_is_evaluated_on_its_rows_in_order():
    pool = LocalEnvPool("inline")
    kwargs = {"dataset": "aime24", "max_turns": 1}
    make = lambda: pool.make("areal_agents/Math-v0", **kwargs)  # noqa: E731
    problems = asyncio.run(load_problems(kwargs, make, num_problems=2))
    rows = raw_rows("aime24")
    assert [(p.number, p.index, p.problem_id) for p in problems.problems] == [
        (0, 0, rows[0]["id"]),
        (1, 1, rows[1]["id"]),
    ]
    assert problems.dataset_hash
    observation, info = asyncio.run(AtProblem(make(), problems.problems[1]).areset(seed=7))
    assert info["index"] == 1 and info["id"] == rows[1]["id"]


def test_a_multi_agent_env_is_refused_by_its_observations():
    make = lambda: LocalEnvPool("inline").make("areal_agents/Debate-v0")  # noqa: E731
    with pytest.raises(ConfigError, match="is a multi-agent env"):
        asyncio.run(load_problems({}, make, num_problems=2, env_id="areal_agents/Debate-v0"))


class EosButLengthEngine(InferenceEngine):
    """Ends every answer with EOS yet reports ``length``: the record must say what the engine said."""

    def __init__(self, tokenizer, stop_reason):
        self.tokenizer, self.stop_reason = tokenizer, stop_reason

    async def agenerate(self, request):
        tokens = self.tokenizer.encode("7", add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return GenResponse(tokens, [-0.1] * len(tokens), [0] * len(tokens), self.stop_reason)


@pytest.mark.parametrize("stop_reason", ["length", "stop"])
def test_the_finish_reason_is_the_engines_stop_reason(tmp_path, tokenizer, stop_reason):
    settings = eval_settings(None, env_id="areal_agents/Arithmetic-v0", num_problems=2, max_new_tokens=8)
    engine = EosButLengthEngine(tokenizer, stop_reason)
    summary = asyncio.run(evaluate_dataset(settings, engine, tokenizer, tmp_path, progress=False))
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert {r["finish_reason"] for r in rows} == {stop_reason}
    assert summary["truncation_rate"] == (1.0 if stop_reason == "length" else 0.0)
    assert summary["episodes"]["submitted"] == summary["episodes"]["accepted"] == 2


class FlakyEngine(EosButLengthEngine):
    """Fails the first try of every sample (an engine fault), then answers."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, "stop")
        self.seen = set()

    async def agenerate(self, request):
        from areal_agents.errors import EngineError

        episode = request.rid.rsplit("/", 1)[0]
        if episode not in self.seen:
            self.seen.add(episode)
            raise EngineError("503 from the server")
        return await super().agenerate(request)


def test_eval_samples_run_through_the_episode_runner_with_retries(tmp_path, tokenizer):
    settings = eval_settings(None, env_id="areal_agents/Arithmetic-v0", num_problems=2, max_new_tokens=8)
    summary = asyncio.run(evaluate_dataset(settings, FlakyEngine(tokenizer), tokenizer, tmp_path, progress=False))
    assert summary["samples"] == 2 and summary["failed_samples"] == 0
    no_retry = eval_settings(None, env_id="areal_agents/Arithmetic-v0", num_problems=2, max_new_tokens=8, max_retries=0)
    with pytest.raises(RunHalted, match=r"eval: none of its 2 samples completed: engine_failed ×2 \(EngineError: 503"):
        asyncio.run(evaluate_dataset(no_retry, FlakyEngine(tokenizer), tokenizer, tmp_path / "b", progress=False))
    assert "EngineError: 503" in (tmp_path / "b" / "failures.log").read_text()  # not an accuracy of 0


def test_eval_options_load_typed_and_name_unknown_keys(tmp_path):
    path = tmp_path / "eval.yaml"
    path.write_text("env: {id: my/Env-v0, kwargs: {max_turns: 2}, module: my_envs}\nmodel: m\nn_samples: 4\n")
    opts = load_config(EvalOptions, path, ["temperature=0.5"])
    assert (opts.env.id, opts.env.kwargs, opts.modules(), opts.n_samples, opts.temperature) == (
        "my/Env-v0",
        {"max_turns": 2},
        ["my_envs"],
        4,
        0.5,
    )
    with pytest.raises(ConfigError, match="unknown config key 'n_sample'.*Did you mean 'n_samples'"):
        load_config(EvalOptions, path, ["n_sample=3"])
    path.write_text("n_samples: four\n")
    with pytest.raises(ConfigError, match="'n_samples'.*expects an integer"):
        load_config(EvalOptions, path)


def test_command_line_flags_win_over_the_file():
    opts = EvalOptions(model="m", n_samples=4, module=["a"])
    opts = with_flags(
        opts, {"n_samples": 2, "env": "my/Env-v0", "env_kwargs": '{"x": 1}', "module": ["b"], "seed": None}
    )
    assert (opts.n_samples, opts.env.id, opts.env.kwargs, opts.module, opts.seed) == (
        2,
        "my/Env-v0",
        {"x": 1},
        ["a", "b"],
        None,
    )
    with pytest.raises(ConfigError, match="--env-kwargs: expects a JSON object"):
        with_flags(opts, {"env_kwargs": "[1]"})
    with pytest.raises(ConfigError, match="eval needs --model"):
        EvalOptions(dataset="aime24").check()
    with pytest.raises(ConfigError, match="eval needs --dataset or --env"):
        EvalOptions(model="m").check()
    assert EvalOptions(model="m", env=opts.env).out_dir() == "runs/eval/my_Env-v0"


def test_cli_eval_takes_key_value_overrides_and_names_unknown_ones(tmp_path, tiny_dir, capsys):
    from areal_agents.cli import main

    args = ["eval", "--env", "areal_agents/Arithmetic-v0", "--model", str(tiny_dir), "--out", str(tmp_path)]
    assert main([*args, "num_problems=2", "max_new_tokens=4", "n_samples=1", "--no-progress"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["finish_reason"] in ("stop", "length") for r in rows)
    assert main([*args, "num_problem=2"]) == 2
    assert "unknown config key 'num_problem' in override 'num_problem=2'. Did you mean 'num_problems'?" in (
        capsys.readouterr().err
    )


def test_every_eval_option_is_a_flag_that_says_what_its_field_says():
    # The flags are made from the fields: one per field (env: --env and --env-kwargs), the field's help line.
    import dataclasses

    from areal_agents.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    flags = {a.dest: a for a in sub.choices["eval"]._actions}
    for f in dataclasses.fields(EvalOptions):
        if f.name == "env":
            assert {"env", "env_kwargs"} <= set(flags)
            continue
        assert flags[f.name].option_strings[0] == "--" + f.name.replace("_", "-")  # a bool: and --no-NAME
        assert flags[f.name].help.startswith(f.metadata["help"].replace("%", "%%")), f.name
        assert flags[f.name].default is None  # not given: the file's value stays
