"""`EvalOptions`: the ``eval`` command's options as a typed config, loaded like train's.

A YAML file (``--config``) and ``key=value`` overrides go through `areal_agents.config.load_config`, so
an unknown key or a wrong type fails with the key named; the command-line flags (`add_flags`: one per field,
its help the field's) then take precedence:

    opts = with_flags(load_config(EvalOptions, "eval.yaml", ["n_samples=4"]), {"model": "runs/m"})
    settings = opts.settings()

``env`` has the shape of a train config's env section (``{id, kwargs, module}``), so one can be reused.
Light on purpose (the eval harness is imported when a run needs it): `areal-agents` builds its parser from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from areal_agents.config import EngineConfig, config_field
from areal_agents.config.flags import add_field_flag, field_help
from areal_agents.errors import ConfigError

if TYPE_CHECKING:
    from areal_agents.eval.runner import EvalSettings


@dataclass
class EvalEnvOptions:
    id: str = config_field("evaluate this env id instead of a dataset's (e.g. my/Env-v0)", default="")
    kwargs: dict[str, Any] = config_field("env kwargs, e.g. {max_turns: 2}", default_factory=dict)
    module: str = config_field("module to import first so that the env registers itself", default="")


@dataclass
class EvalOptions:
    model: str = config_field("model directory (a transformers checkpoint)", default="")
    dataset: str = config_field(
        "a preset (aime24, aime25, math500, gsm8k, lcb, humaneval), a bundled set (areal-agents datasets), "
        "a JSONL path, or hf:ORG/NAME",
        default="",
    )
    preset: str = config_field(
        "settings for a path or id: aime24, aime25, math500, gsm8k, math, lcb, humaneval, code", default=""
    )
    hub: bool = config_field("load the preset's copy from the Hugging Face hub, not the bundled one", default=False)
    env: EvalEnvOptions = field(default_factory=EvalEnvOptions)
    module: list[str] = config_field("modules to import first (they register env ids)", default_factory=list)
    num_problems: int | None = config_field(
        "the first N problems (an env without a dataset: seeds 0..N-1)", default=None
    )
    success_threshold: float = config_field(
        "the return that counts as success when the env reports no info['success']", default=1.0
    )
    engine: Literal["hf", "serve-model", "sglang", "vllm"] = config_field("the inference engine", default="hf")
    engine_url: list[str] = config_field("running servers of that engine", default_factory=list)
    vllm_python: str = config_field("vllm: the Python of an environment with vLLM", default="")
    sglang_python: str = config_field("sglang: the Python of an environment with SGLang", default="")
    n_samples: int | None = config_field("samples per problem (default: the preset's)", default=None)
    temperature: float | None = config_field("default: the preset's", default=None)
    top_p: float | None = config_field("default: the preset's", default=None)
    max_new_tokens: int | None = config_field("default: the preset's", default=None)
    concurrency: int | None = config_field("episodes in flight (default 64)", default=None)
    seed: int | None = config_field("sampling seed (default 0)", default=None)
    max_retries: int | None = config_field(
        "tries more for a sample whose env or engine failed (default 1)", default=None
    )
    system_prompt: str = config_field("system message of every episode", default="")
    lcb_start: str = config_field(
        "LiveCodeBench: problems with contest_date >= this (ISO date, quoted in YAML)", default=""
    )
    lcb_end: str = config_field("LiveCodeBench: ... and < this date", default="")
    out: str = config_field(
        "output directory; a rerun of the same model and settings resumes (default runs/eval/DATASET or ENV, or "
        "-2, -3, ... when that holds another run's samples; an --out that does needs --overwrite)",
        default="",
    )

    def check(self) -> None:
        """What every run needs: a model, and a dataset or an env; a ``max_new_tokens`` given within the
        model's context (a preset's default stays: the engine caps each turn at the context left)."""
        if not self.model:
            raise ConfigError("eval needs --model (or 'model:' in --config)")
        if not (self.dataset or self.env.id):
            raise ConfigError("eval needs --dataset or --env (or 'dataset:' / 'env: {id: ...}' in --config)")
        if self.max_new_tokens is not None:
            from areal_agents.models.loading import check_max_new_tokens  # transformers: only for a run

            check_max_new_tokens(self.max_new_tokens, self.model, "max_new_tokens (--max-new-tokens)")

    def modules(self) -> list[str]:
        """The modules to import before the env is made."""
        return [*self.module, *([self.env.module] if self.env.module else [])]

    def settings(self) -> EvalSettings:
        from areal_agents.eval.runner import eval_settings

        window = (self.lcb_start, self.lcb_end or "9999-12-31") if self.lcb_start else None
        return eval_settings(
            self.dataset or None,
            env_id=self.env.id or None,
            env_kwargs=self.env.kwargs,
            preset=self.preset or None,
            hub=self.hub,
            n_samples=self.n_samples,
            temperature=self.temperature,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens,
            concurrency=self.concurrency,
            seed=self.seed,
            max_retries=self.max_retries,
            system_prompt=self.system_prompt or None,
            date_range=window,
            num_problems=self.num_problems,
            success_threshold=self.success_threshold,
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            backend=self.engine,
            urls=list(self.engine_url),
            vllm_python=self.vllm_python,
            sglang_python=self.sglang_python,
        )

    def out_dir(self) -> str:
        """``out``, or runs/eval/ named after the dataset or the env."""
        name = Path(self.dataset).stem if self.dataset else re.sub(r"[^\w.-]+", "_", self.env.id)
        return self.out or str(Path("runs/eval") / name)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `EvalOptions` field, its help the field's; ``env`` is ``--env`` (its id) and ``--env-kwargs``."""
    for f in dataclasses.fields(EvalOptions):
        if f.name != "env":
            add_field_flag(parser, EvalOptions, f.name)
            continue
        env_id = next(f for f in dataclasses.fields(EvalEnvOptions) if f.name == "id")
        parser.add_argument("--env", default=None, help=field_help(env_id))
        parser.add_argument("--env-kwargs", default=None, help="JSON object of env kwargs, e.g. '{\"max_turns\": 2}'")


def with_flags(options: EvalOptions, flags: dict[str, Any]) -> EvalOptions:
    """``options`` with the command-line flags that were given (not None) in their place; ``env`` and
    ``env_kwargs`` (JSON text) set ``env.id`` and ``env.kwargs``, ``module`` adds to the file's."""
    given = {k: v for k, v in flags.items() if v is not None}
    env = options.env
    if "env" in given or "env_kwargs" in given:
        kwargs = _json_object(given.pop("env_kwargs")) if "env_kwargs" in given else env.kwargs
        env = dataclasses.replace(env, id=given.pop("env", env.id), kwargs=kwargs)
    if "module" in given:
        given["module"] = [*options.module, *given["module"]]
    names = {f.name for f in dataclasses.fields(EvalOptions)}
    unknown = sorted(set(given) - names)
    if unknown:
        raise ValueError(f"with_flags: expects flags named as EvalOptions fields, got {unknown}")
    try:
        return dataclasses.replace(options, env=env, **given)
    except ValueError as e:
        raise ConfigError(f"eval: {e}") from None


def _json_object(text: str) -> dict[str, Any]:
    """``--env-kwargs`` as a mapping (JSON text)."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"--env-kwargs: expects a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--env-kwargs: expects a JSON object (a mapping), got {text!r}")
    return value
