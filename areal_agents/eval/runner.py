"""`areal-agents eval`: n samples per problem through the training envs and engines; scored, saved, resumable.

Any registered env evaluates: its problems (`load_problems`) are the rows of the dataset its kwargs name,
else the episodes reset with seeds 0..num_problems-1. Every sample is one episode of the rollout's
`EpisodeRunner`, retried and counted as in training. A sample succeeds when the env's last info says so
(``success``, or ``correct`` as the math and code envs report it), else when its return reaches
``success_threshold``.

Writes ``OUT/samples.jsonl`` (one line per finished sample, appended as they finish, so an interrupted
run keeps what it scored and a rerun does only the rest) and ``OUT/summary.json`` (avg@n, pass@k, maj@k,
mean response length, truncation rate, per-difficulty breakdown, the model). Each sample's
``finish_reason`` is the engine's ``stop_reason`` of its last generation (``stop``, ``length``, ...).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from areal_agents.agents.chat_agent import ChatAgent
from areal_agents.config import EngineConfig
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.local_servers import open_engine
from areal_agents.envs.runtime.pool import LocalEnvPool
from areal_agents.errors import ConfigError, RunHalted
from areal_agents.eval.presets import Preset, resolve
from areal_agents.eval.problems import AtProblem, Problem, load_problems
from areal_agents.eval.provenance import RunMismatch, claim, clear, fresh_candidates, model_digest
from areal_agents.eval.summary import print_summary, summarize
from areal_agents.models.loading import load_tokenizer, model_context, warn_prompts_over_context
from areal_agents.progress import plural, progress_bar
from areal_agents.rollout.episodes import EpisodeRunner, RolloutLedger
from areal_agents.rollout.failures import FailureLog
from areal_agents.types import SamplingParams, Trajectory

__all__ = ["EvalSettings", "eval_settings", "evaluate_dataset", "print_summary", "run_eval", "summarize"]


@dataclass
class EvalSettings:
    env_id: str
    env_kwargs: dict[str, Any]
    n_samples: int
    temperature: float
    top_p: float
    max_new_tokens: int
    concurrency: int = 64
    seed: int = 0
    breakdown: tuple[str, ...] = ()
    system_prompt: str = ""
    date_range: tuple[str, str] | None = None  # keep rows whose contest_date is in [start, end) (ISO dates)
    num_problems: int | None = None  # the first N problems (rows, or seeds 0..N-1 of an env without a dataset)
    success_threshold: float = 1.0  # a sample's return that counts as success when the env reports none
    max_retries: int = 1  # tries more for a sample whose env or engine failed

    def __post_init__(self) -> None:
        """Out-of-range numbers stop here, named as the command line spells them."""
        if self.max_retries < 0:
            raise ConfigError(f"--max-retries must be >= 0, got {self.max_retries}")
        for name in ("n_samples", "concurrency", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.num_problems is not None and self.num_problems < 1:
            raise ConfigError(f"--num-problems must be >= 1, got {self.num_problems}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"--temperature must be >= 0 and --top-p in (0, 1], got {self.temperature}, {self.top_p}")


def _done(path: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """Samples already scored by an earlier (interrupted) run, by (problem index, sample). A last line
    cut by an interruption is ended, so the next record starts a line of its own."""
    out = {}
    text = path.read_text() if path.is_file() else ""
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the interruption: that sample runs again
        out[(row["index"], row["sample"])] = row
    if text and not text.endswith("\n"):
        with path.open("a") as f:
            f.write("\n")
    return out


def _identity(settings: EvalSettings, base: dict[str, Any] | None, dataset_hash: str | None) -> dict[str, Any]:
    """What the samples depend on: ``base`` (model, engine), the env, the sampling, the dataset."""
    sampling = {k: getattr(settings, k) for k in ("temperature", "top_p", "max_new_tokens", "system_prompt", "seed")}
    env = {"id": settings.env_id, "kwargs": settings.env_kwargs}
    return {**(base or {}), "env": env, "sampling": sampling, "dataset_hash": dataset_hash}


def _outcome(trajectories: list[Trajectory] | None) -> dict[str, Any]:
    """A sample's completion, answer, reward, tokens and finish reason (the engine's stop reason of its last
    generation); no trajectory means the prompt left the model no room to answer (longer than its
    context): a wrong sample, finished by length."""
    if not trajectories:
        return {"completion": "", "answer": None, "info": {}, "reward": 0.0, "tokens": 0, "finish_reason": "length"}
    t = trajectories[-1]
    info = t.metadata.get("final_info", {})
    stop_reasons = t.metadata.get("stop_reasons") or ["length"]
    return {
        "completion": t.metadata["messages"][-1]["content"],
        "answer": info.get("answer"),
        "info": info,
        "reward": t.reward,
        "tokens": sum(x.num_generated for x in trajectories),
        "finish_reason": stop_reasons[-1],
    }


def _success(info: dict[str, Any], reward: float, threshold: float) -> bool:
    for key in ("success", "correct"):
        if key in info:
            return bool(info[key])
    return reward >= threshold


async def evaluate_dataset(
    settings: EvalSettings,
    engine: InferenceEngine,
    tokenizer: Any,
    out_dir: str | Path | Sequence[Path],
    progress: bool = True,
    identity: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run every (problem, sample) not yet in ``samples.jsonl``; return (and write) the summary.

    ``out_dir`` may be a list of candidate directories: the run goes to the first one whose samples come
    from this same run (or that holds none); the summary's ``out`` says which.

    Each sample is one episode of the `EpisodeRunner` (env and engine failures retried
    ``settings.max_retries`` times, every sample counted in the summary's ``episodes`` ledger); a sample
    that still fails is left out of ``samples.jsonl``, so a rerun runs it again; when none completes, this
    raises `RunHalted` (an accuracy over no samples would be a lie). ``identity`` (the model
    and engine, see `run_eval`) joins the settings and the dataset's hash in ``run.json``: samples of
    another run there raise `RunMismatch` before anything is generated."""
    candidates = [Path(out_dir)] if isinstance(out_dir, (str, Path)) else [Path(c) for c in out_dir]
    pool = LocalEnvPool("thread", workers=4, step_timeout=None)
    try:
        source = await load_problems(
            settings.env_kwargs,
            lambda: pool.make(settings.env_id, **settings.env_kwargs),
            num_problems=settings.num_problems,
            date_range=settings.date_range,
            env_id=settings.env_id,
        )
        identity = _identity(settings, identity, source.dataset_hash)
        out = _claim_first(candidates, identity)
        done, ledger = await _run_samples(settings, engine, tokenizer, pool, source.problems, out, identity, progress)
    finally:
        await pool.aclose()
    chosen = {p.number for p in source.problems}
    rows = [r for r in done.values() if r["index"] in chosen]
    summary = summarize(rows, settings.n_samples, settings.breakdown)
    # a prompt longer than the model's context leaves no room: its samples hold no tokens (`_outcome`)
    summary["prompts_over_context"] = len({r["index"] for r in rows if r["tokens"] == 0 and not r["completion"]})
    failed = ledger.failed + ledger.env_failed + ledger.engine_failed + ledger.worker_failed
    summary["failed_samples"] = failed  # not in samples.jsonl: a rerun runs them again
    summary["episodes"] = ledger.counts()
    if source.notes:
        summary["notes"] = source.notes
    summary |= {"settings": asdict(settings), "run": identity, "out": str(out)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _claim_first(candidates: list[Path], identity: dict[str, Any]) -> Path:
    """The first candidate directory `claim` takes for this run; the last one's `RunMismatch` if none."""
    for out in candidates[:-1]:
        try:
            claim(out, identity)
            return out
        except RunMismatch:
            continue
    claim(candidates[-1], identity)
    return candidates[-1]


async def _run_samples(
    settings: EvalSettings,
    engine: InferenceEngine,
    tokenizer: Any,
    pool: LocalEnvPool,
    problems: list[Problem],
    out: Path,
    identity: dict[str, Any],
    progress: bool,
) -> tuple[dict[tuple[int, int], dict[str, Any]], RolloutLedger]:
    """Run the samples not yet in ``OUT/samples.jsonl``, each appended as it finishes; all the samples
    scored there, by (problem, sample), and the ledger of this run's episodes."""
    samples_path = out / "samples.jsonl"
    stamp = {k: identity.get(k) for k in ("model", "model_hash", "engine", "sampling", "dataset_hash")}
    done = _done(samples_path)
    todo = [(p, j) for p in problems for j in range(settings.n_samples) if (p.number, j) not in done]
    sampling = SamplingParams(settings.max_new_tokens, settings.temperature, settings.top_p)
    agent = ChatAgent(engine, tokenizer, sampling, system_prompt=settings.system_prompt)
    failures = FailureLog(out / "failures.log")  # rate-limited lines; the first traceback of each cause
    runner = EpisodeRunner(max_retries=settings.max_retries, failures=failures)
    gate = asyncio.Semaphore(settings.concurrency)
    bar = progress_bar(total=len(todo), desc="eval", enabled=progress)

    async def one(problem: Problem, j: int) -> None:
        episode_id = f"p{problem.number}/s{j}"

        def episode() -> Awaitable[list[Trajectory]]:
            env = AtProblem(pool.make(settings.env_id, **settings.env_kwargs), problem)
            return agent.run_episode(env, seed=settings.seed + j, episode_id=episode_id)

        async with gate:
            trajectories = await runner.run(episode, episode_id)
        bar.update()
        if trajectories is None:
            return  # failed (logged, counted in the ledger): a rerun runs it again
        record = {"problem_id": problem.problem_id, "index": problem.number, "sample": j, **_outcome(trajectories)}
        record["correct"] = _success(record.pop("info"), record["reward"], settings.success_threshold)
        record |= {**{k: problem.row[k] for k in settings.breakdown if k in problem.row}, "run": stamp}
        with samples_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        done[(problem.number, j)] = record

    try:
        await asyncio.gather(*(one(p, j) for p, j in todo))
    finally:
        bar.close()
        failures.flush()
    if todo and runner.ledger.accepted == 0:
        causes = failures.describe(failures.totals) or "see the log"
        raise RunHalted(f"eval: none of its {plural(len(todo), 'sample')} completed: {causes}")
    return done, runner.ledger


def eval_settings(
    dataset: str | None,
    *,
    env_id: str | None = None,
    env_kwargs: dict[str, Any] | None = None,
    preset: str | None = None,
    hub: bool = False,
    **overrides: Any,
) -> EvalSettings:
    """Settings for ``--dataset`` (through its preset) or ``--env`` (a user's env, its kwargs as given);
    ``overrides`` (n_samples, temperature, ...) that are None keep the preset's values."""
    kwargs = dict(env_kwargs or {})
    if env_id and not (dataset or preset):
        p = Preset(env_id, "", max_new_tokens=4096)
    else:
        if not dataset:
            raise ConfigError("eval needs --dataset (a preset, a bundled set, a JSONL path or a hub id) or --env")
        source, split, p = resolve(dataset, preset, hub)
        if not source:
            raise ConfigError(f"--dataset {dataset!r}: give a JSONL path, a bundled set or a hub id")
        kwargs = {**p.env_kwargs, "dataset": source, **({"split": split} if split else {}), **kwargs}
    values = {k: v for k, v in overrides.items() if v is not None}
    return EvalSettings(
        env_id=env_id or p.env_id,
        env_kwargs=kwargs,
        n_samples=values.pop("n_samples", p.n_samples),
        temperature=values.pop("temperature", p.temperature),
        top_p=values.pop("top_p", p.top_p),
        max_new_tokens=values.pop("max_new_tokens", p.max_new_tokens),
        breakdown=p.breakdown,
        **values,
    )


def run_eval(
    settings: EvalSettings,
    model_path: str,
    out_dir: str | Path,
    *,
    engine: EngineConfig | None = None,
    progress: bool = True,
    new_dir_on_mismatch: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Evaluate ``model_path`` with ``settings`` (see `eval_settings`) into ``out_dir``, resuming the
    samples there when they come from the same model, engine, settings and dataset. With
    ``new_dir_on_mismatch`` (no ``--out`` given) samples of another run send this one to ``OUT-2``, ...;
    else they raise `RunMismatch` naming what differs. ``overwrite`` removes an earlier run's files from
    ``out_dir`` first and starts there. The summary's ``out`` says where it went."""
    engine = engine or EngineConfig()
    tokenizer = load_tokenizer(model_path)
    identity = {
        "model": str(model_path),
        "model_hash": model_digest(model_path),
        "engine": {"backend": engine.backend, "urls": list(engine.urls)},
    }
    if overwrite:
        clear(Path(out_dir))
    candidates = fresh_candidates(Path(out_dir)) if new_dir_on_mismatch and not overwrite else [Path(out_dir)]
    rollout_engine, servers = open_engine(engine, model_path, "float32", run_dir=Path(out_dir), seed=settings.seed)

    async def main() -> dict[str, Any]:
        try:
            return await evaluate_dataset(settings, rollout_engine, tokenizer, candidates, progress, identity)
        finally:
            await rollout_engine.aclose()

    try:
        summary = asyncio.run(main())
    finally:
        if servers is not None:
            servers.stop()
    unfit, context = summary["prompts_over_context"], model_context(model_path)
    warn_prompts_over_context(unfit, summary.get("problems", 0), context, "eval")
    return summary
