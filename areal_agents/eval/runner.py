"""`areal-agents eval`: n samples per problem through the training envs and engines; scored, saved, resumable.

Writes ``OUT/samples.jsonl`` (one line per finished sample, appended as they finish, so an interrupted run
keeps what it scored and a rerun does only the rest) and ``OUT/summary.json`` (avg@n, pass@k, maj@k, mean
response length, truncation rate, per-difficulty breakdown).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from areal_agents.agents.chat_agent import ChatAgent
from areal_agents.config import EngineConfig
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.launcher import open_engine
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.envs.pool import LocalEnvPool
from areal_agents.errors import ConfigError
from areal_agents.eval.metrics import maj_at_k, pass_at_k, report_ks
from areal_agents.eval.presets import resolve
from areal_agents.models.loading import load_tokenizer
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


class _AtIndex:
    """An `AsyncEnv` that always resets to problem ``index`` of its dataset."""

    def __init__(self, env: AsyncEnv, index: int) -> None:
        self.env, self.index = env, index

    async def areset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        return await self.env.areset(seed=seed, options={**(options or {}), "index": self.index})

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


async def evaluate_dataset(
    settings: EvalSettings, engine: InferenceEngine, tokenizer: Any, out_dir: str | Path, progress: bool = True
) -> dict[str, Any]:
    """Run every (problem, sample) not yet in ``samples.jsonl``; return (and write) the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    samples_path = out / "samples.jsonl"
    pool = LocalEnvPool("thread", workers=4, step_timeout=None)
    probe = pool.make(settings.env_id, **settings.env_kwargs)
    rows = probe.env.unwrapped.data.rows
    await probe.aclose()
    done = _done(samples_path)
    problems = [i for i, row in enumerate(rows) if _in_window(row, settings.date_range)]
    if not problems:
        raise ConfigError(
            f"no problem of {settings.env_kwargs.get('dataset')} has a contest_date in {settings.date_range}"
        )
    todo = [(i, j) for i in problems for j in range(settings.n_samples) if (i, j) not in done]
    sampling = SamplingParams(settings.max_new_tokens, settings.temperature, settings.top_p)
    agent = ChatAgent(engine, tokenizer, sampling, system_prompt=settings.system_prompt)
    gate = asyncio.Semaphore(settings.concurrency)
    bar = tqdm(total=len(todo), desc="eval", disable=not progress, dynamic_ncols=True)

    failed: list[str] = []

    async def one(i: int, j: int) -> None:
        async with gate:
            env = _AtIndex(pool.make(settings.env_id, **settings.env_kwargs), i)
            try:
                trajectories = await agent.run_episode(env, seed=settings.seed + j, episode_id=f"p{i}/s{j}")
            except Exception as e:  # noqa: BLE001  (one bad sample must not end the run; a rerun retries it)
                logger.warning("problem %d sample %d failed: %s: %s", i, j, type(e).__name__, e)
                failed.append(f"{i}/{j}")
                bar.update()
                return
        t = trajectories[-1]
        info = t.metadata.get("final_info", {})
        last = t.input_ids[-1] if t.input_ids else None
        record = {
            "problem_id": rows[i].get("id", str(i)),
            "index": i,
            "sample": j,
            "completion": t.metadata["messages"][-1]["content"],
            "answer": info.get("answer"),
            "correct": bool(info.get("correct", t.reward >= 1.0)),
            "reward": t.reward,
            "tokens": sum(x.num_generated for x in trajectories),
            "finish_reason": "stop" if last == tokenizer.eos_token_id else "length",
            **{k: rows[i][k] for k in settings.breakdown if k in rows[i]},
        }
        with samples_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        done[(i, j)] = record
        bar.update()

    try:
        await asyncio.gather(*(one(i, j) for i, j in todo))
    finally:
        bar.close()
        await pool.aclose()
    chosen = set(problems)
    summary = summarize([r for r in done.values() if r["index"] in chosen], settings.n_samples, settings.breakdown)
    summary["failed_samples"] = len(failed)  # not in samples.jsonl: a rerun runs them again
    summary["settings"] = asdict(settings)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def run_eval(
    dataset: str,
    model_path: str,
    out_dir: str | Path,
    *,
    preset: str | None = None,
    engine: EngineConfig | None = None,
    n_samples: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    max_new_tokens: int | None = None,
    concurrency: int = 64,
    seed: int = 0,
    system_prompt: str = "",
    date_range: tuple[str, str] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Evaluate ``model_path`` on ``dataset`` (a preset name, a JSONL path or an HF id); unset sampling
    settings come from the preset."""
    source, p = resolve(dataset, preset)
    if not source:
        raise ConfigError(f"--dataset {dataset!r}: give a JSONL path or a Hugging Face id")
    settings = EvalSettings(
        env_id=p.env_id,
        env_kwargs={**p.env_kwargs, "dataset": source, "split": p.split},
        n_samples=n_samples or p.n_samples,
        temperature=p.temperature if temperature is None else temperature,
        top_p=p.top_p if top_p is None else top_p,
        max_new_tokens=max_new_tokens or p.max_new_tokens,
        concurrency=concurrency,
        seed=seed,
        breakdown=p.breakdown,
        system_prompt=system_prompt,
        date_range=date_range,
    )
    out = Path(out_dir)
    tokenizer = load_tokenizer(model_path)
    rollout_engine, servers = open_engine(engine or EngineConfig(), model_path, "float32", run_dir=out, seed=seed)

    async def main() -> dict[str, Any]:
        try:
            return await evaluate_dataset(settings, rollout_engine, tokenizer, out, progress)
        finally:
            await rollout_engine.aclose()

    try:
        return asyncio.run(main())
    finally:
        if servers is not None:
            servers.stop()


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
