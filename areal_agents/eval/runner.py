"""`areal-agents eval`: n samples per problem through the training envs and engines; scored, saved, resumable.

Any registered env evaluates: its problems are its dataset's rows when it has one (``env.unwrapped.data``),
else the episodes reset with seeds 0..num_problems-1. A sample succeeds when the env's last info says so
(``success``, or ``correct`` as the math and code envs report it), else when its return reaches
``success_threshold``.

Writes ``OUT/samples.jsonl`` (one line per finished sample, appended as they finish, so an interrupted
run keeps what it scored and a rerun does only the rest) and ``OUT/summary.json`` (avg@n, pass@k, maj@k,
mean response length, truncation rate, per-difficulty breakdown, the model).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from areal_agents.agents.chat_agent import ChatAgent
from areal_agents.config import EngineConfig
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.local_servers import open_engine
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.envs.runtime.pool import LocalEnvPool
from areal_agents.errors import ConfigError
from areal_agents.eval.metrics import maj_at_k, pass_at_k, report_ks
from areal_agents.eval.presets import Preset, resolve
from areal_agents.eval.provenance import RunMismatch, claim, fresh_candidates, model_digest, rows_digest
from areal_agents.models.loading import load_tokenizer
from areal_agents.progress import progress_bar
from areal_agents.types import SamplingParams

logger = logging.getLogger(__name__)


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

    def __post_init__(self) -> None:
        """Out-of-range numbers stop here, named as the command line spells them."""
        for name in ("n_samples", "concurrency", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.num_problems is not None and self.num_problems < 1:
            raise ConfigError(f"--num-problems must be >= 1, got {self.num_problems}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"--temperature must be >= 0 and --top-p in (0, 1], got {self.temperature}, {self.top_p}")


@dataclass(frozen=True)
class Problem:
    """One problem: a dataset row (``index`` set) or an env seed (``row`` empty)."""

    number: int
    problem_id: str
    index: int | None = None
    seed: int | None = None
    row: dict[str, Any] = field(default_factory=dict)


class _AtProblem:
    """An `AsyncEnv` that always resets to one problem: its dataset row, or its seed."""

    def __init__(self, env: AsyncEnv, problem: Problem) -> None:
        self.env, self.problem = env, problem

    async def areset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        if self.problem.index is None:
            return await self.env.areset(seed=self.problem.seed, options=options)
        return await self.env.areset(seed=seed, options={**(options or {}), "index": self.problem.index})

    async def astep(self, action: str):  # noqa: ANN201
        return await self.env.astep(action)

    async def aclose(self) -> None:
        await self.env.aclose()


def _in_window(row: dict[str, Any], window: tuple[str, str] | None) -> bool:
    if window is None:
        return True
    date = str(row.get("contest_date") or "")[:10]
    return bool(date) and window[0] <= date < window[1]


def _done(path: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """Samples already scored by an earlier (interrupted) run, by (problem index, sample)."""
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by the interruption: that sample runs again
            out[(row["index"], row["sample"])] = row
    return out


def _problems(settings: EvalSettings, data: Any) -> list[Problem]:
    """The problems to evaluate: the dataset's rows (in the date window), or seeds 0..num_problems-1."""
    if data is None:
        if not settings.num_problems:
            raise ConfigError(
                f"{settings.env_id} has no dataset: give --num-problems (episodes reset with seeds 0..N-1)"
            )
        return [Problem(k, f"seed{k}", seed=k) for k in range(settings.num_problems)]
    rows = [(i, row) for i, row in enumerate(data.rows) if _in_window(row, settings.date_range)]
    if not rows:
        raise ConfigError(
            f"no problem of {settings.env_kwargs.get('dataset')} has a contest_date in {settings.date_range}"
        )
    rows = rows[: settings.num_problems] if settings.num_problems else rows
    return [Problem(i, str(row.get("id", i)), index=i, row=row) for i, row in rows]


def _notes(data: Any, env: Any) -> list[str]:
    """What a reader of the scores must know: LiveCodeBench rows without hidden tests."""
    if getattr(env, "format", None) == "lcb" and not any(r.get("private_test_cases") for r in data.rows):
        return [
            "LiveCodeBench public tests only: these scores are not comparable to published LiveCodeBench scores, "
            "which judge hidden tests too"
        ]
    return []


async def _probe(settings: EvalSettings, pool: LocalEnvPool) -> tuple[list[Problem], list[str], str | None]:
    """The problems, the notes on them, and the hash of the env's dataset (None for an env without one)."""
    probe = pool.make(settings.env_id, **settings.env_kwargs)
    try:
        env = getattr(probe, "env", None)
        if env is None:
            raise ConfigError(f"{settings.env_id} is a multi-agent env; eval runs single-agent envs")
        data = getattr(env.unwrapped, "data", None)
        if not hasattr(data, "rows"):
            return _problems(settings, None), [], None
        return _problems(settings, data), _notes(data, env.unwrapped), rows_digest(data.rows)
    finally:
        await probe.aclose()


def _identity(settings: EvalSettings, base: dict[str, Any] | None, dataset_hash: str | None) -> dict[str, Any]:
    """What the samples depend on: ``base`` (model, engine), the env, the sampling, the dataset."""
    sampling = {k: getattr(settings, k) for k in ("temperature", "top_p", "max_new_tokens", "system_prompt", "seed")}
    env = {"id": settings.env_id, "kwargs": settings.env_kwargs}
    return {**(base or {}), "env": env, "sampling": sampling, "dataset_hash": dataset_hash}


def _outcome(trajectories: list[Any], tokenizer: Any) -> dict[str, Any]:
    """A sample's completion, answer, reward, tokens and finish reason; no trajectory means the prompt
    left the model no room to answer (longer than its context): a wrong sample, finished by length."""
    if not trajectories:
        return {"completion": "", "answer": None, "info": {}, "reward": 0.0, "tokens": 0, "finish_reason": "length"}
    t = trajectories[-1]
    info = t.metadata.get("final_info", {})
    last = t.input_ids[-1] if t.input_ids else None
    return {
        "completion": t.metadata["messages"][-1]["content"],
        "answer": info.get("answer"),
        "info": info,
        "reward": t.reward,
        "tokens": sum(x.num_generated for x in trajectories),
        "finish_reason": "stop" if last == tokenizer.eos_token_id else "length",
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
    out_dir: str | Path,
    progress: bool = True,
    identity: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run every (problem, sample) not yet in ``samples.jsonl``; return (and write) the summary.

    ``identity`` (the model and engine, see `run_eval`) joins the settings and the dataset's hash in
    ``run.json``: samples of another run there raise `RunMismatch` before anything is generated."""
    out = Path(out_dir)
    samples_path = out / "samples.jsonl"
    pool = LocalEnvPool("thread", workers=4, step_timeout=None)
    try:
        problems, notes, dataset_hash = await _probe(settings, pool)
        identity = _identity(settings, identity, dataset_hash)
        claim(out, identity)
    except BaseException:
        await pool.aclose()
        raise
    stamp = {k: identity.get(k) for k in ("model", "model_hash", "engine", "sampling", "dataset_hash")}
    done = _done(samples_path)
    todo = [(p, j) for p in problems for j in range(settings.n_samples) if (p.number, j) not in done]
    sampling = SamplingParams(settings.max_new_tokens, settings.temperature, settings.top_p)
    agent = ChatAgent(engine, tokenizer, sampling, system_prompt=settings.system_prompt)
    gate = asyncio.Semaphore(settings.concurrency)
    bar = progress_bar(total=len(todo), desc="eval", enabled=progress)

    failed: list[str] = []

    async def one(problem: Problem, j: int) -> None:
        i = problem.number
        async with gate:
            env = _AtProblem(pool.make(settings.env_id, **settings.env_kwargs), problem)
            try:
                trajectories = await agent.run_episode(env, seed=settings.seed + j, episode_id=f"p{i}/s{j}")
            except Exception as e:  # noqa: BLE001  (one bad sample must not end the run; a rerun retries it)
                logger.warning("problem %d sample %d failed: %s: %s", i, j, type(e).__name__, e)
                failed.append(f"{i}/{j}")
                bar.update()
                return
        record = {"problem_id": problem.problem_id, "index": i, "sample": j, **_outcome(trajectories, tokenizer)}
        record["correct"] = _success(record.pop("info"), record["reward"], settings.success_threshold)
        record |= {
            **{k: problem.row[k] for k in settings.breakdown if k in problem.row},
            "run": stamp,
        }
        with samples_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        done[(i, j)] = record
        bar.update()

    try:
        await asyncio.gather(*(one(p, j) for p, j in todo))
    finally:
        bar.close()
        await pool.aclose()
    chosen = {p.number for p in problems}
    summary = summarize([r for r in done.values() if r["index"] in chosen], settings.n_samples, settings.breakdown)
    summary["failed_samples"] = len(failed)  # not in samples.jsonl: a rerun runs them again
    if notes:
        summary["notes"] = notes
    summary["settings"] = asdict(settings)
    summary["run"] = identity
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


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
) -> dict[str, Any]:
    """Evaluate ``model_path`` with ``settings`` (see `eval_settings`) into ``out_dir``, resuming the
    samples there when they come from the same model, engine, settings and dataset. With
    ``new_dir_on_mismatch`` (no ``--out`` given) samples of another run send this one to ``OUT-2``, ...;
    else they raise `RunMismatch` naming what differs. The summary's ``out`` says where it went."""
    engine = engine or EngineConfig()
    tokenizer = load_tokenizer(model_path)
    identity = {
        "model": str(model_path),
        "model_hash": model_digest(model_path),
        "engine": {"backend": engine.backend, "urls": list(engine.urls)},
    }
    candidates = fresh_candidates(Path(out_dir)) if new_dir_on_mismatch else [Path(out_dir)]
    rollout_engine, servers = open_engine(engine, model_path, "float32", run_dir=Path(out_dir), seed=settings.seed)

    async def main() -> tuple[Path, dict[str, Any]]:
        try:
            for out in candidates:
                try:
                    return out, await evaluate_dataset(settings, rollout_engine, tokenizer, out, progress, identity)
                except RunMismatch:
                    if out == candidates[-1]:
                        raise
            raise AssertionError("unreachable")
        finally:
            await rollout_engine.aclose()

    try:
        out, summary = asyncio.run(main())
    finally:
        if servers is not None:
            servers.stop()
    summary["out"] = str(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def print_summary(summary: dict[str, Any], title: str = "") -> None:
    """The headline metrics as a console table (rich), then the breakdowns."""
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    table = Table(title=title or None)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k in summary:
        if k.startswith(("avg@", "pass@", "maj@")):
            table.add_row(k, f"{100 * summary[k]:.1f}%")
    table.add_row("mean tokens", f"{summary.get('mean_tokens', 0.0):.1f}")
    table.add_row("truncated", f"{100 * summary.get('truncation_rate', 0.0):.1f}%")
    table.add_row("problems / samples", f"{summary.get('problems', 0)} / {summary.get('samples', 0)}")
    console = Console()
    console.print(table)
    for key, groups in summary.items():
        if key.startswith("by_"):
            sub = Table(title=key.removeprefix("by_"))
            sub.add_column(key.removeprefix("by_"))
            sub.add_column("problems", justify="right")
            sub.add_column("accuracy", justify="right")
            for name, row in groups.items():
                acc = next(v for k, v in row.items() if k.startswith("avg@"))
                sub.add_row(name, str(row["problems"]), f"{100 * acc:.1f}%")
            console.print(sub)
    for note in summary.get("notes", []):
        console.print(f"note: {note}")


def summarize(records: list[dict[str, Any]], n: int, breakdown: tuple[str, ...] = ()) -> dict[str, Any]:
    """avg@n, pass@k and maj@k (k = 1, 2, 4, ..., n) over problems, response length, truncation rate."""
    by_problem: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_problem[r["index"]].append(r)
    problems = [sorted(v, key=lambda r: r["sample"]) for _, v in sorted(by_problem.items())]
    if not problems:
        return {"problems": 0, "samples": 0}
    out: dict[str, Any] = {"problems": len(problems), "samples": len(records), "n": n}
    out[f"avg@{n}"] = _mean([_mean([s["correct"] for s in p]) for p in problems])
    for k in report_ks(n):
        out[f"pass@{k}"] = _mean([pass_at_k(len(p), sum(s["correct"] for s in p), k) for p in problems if len(p) >= k])
        answers = [[s["answer"] for s in p] for p in problems]
        if any(a is not None for p in answers for a in p):  # code has no answer to vote on
            correct = [[s["correct"] for s in p] for p in problems]
            out[f"maj@{k}"] = _mean([maj_at_k(a, c, k) for a, c in zip(answers, correct)])
    out["mean_tokens"] = _mean([r["tokens"] for r in records])
    out["truncation_rate"] = _mean([r["finish_reason"] == "length" for r in records])
    for key in breakdown:
        groups: dict[str, list[float]] = defaultdict(list)
        for p in problems:
            if key in p[0]:
                groups[str(p[0][key])].append(_mean([s["correct"] for s in p]))
        if groups:
            out[f"by_{key}"] = {g: {"problems": len(v), f"avg@{n}": _mean(v)} for g, v in sorted(groups.items())}
    return out


def _mean(values: list[float]) -> float:
    return float(sum(values)) / len(values) if values else 0.0
