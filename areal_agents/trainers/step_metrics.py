"""What one RL step logs to TensorBoard: ``rollout/`` (rewards, accuracy, the truncated fraction, the ledger,
staleness), ``train/`` (each policy's update), ``perf/`` (throughput and where the step's time went) and
``engine/`` (the serving engine's counters per step, when it reports them:
`areal_agents.engines.base.InferenceEngine.counters`); and the totals over the run's steps that its summary reports;
and the step's trajectories as JSONL (``rollout.dump_trajectories``).

Example::

    log = StepLog(metrics, controller, ledger, env_id="Arithmetic-v0", engine=policy.engine)
    await log.start()  # the engine's counters from here on
    shown = await log.record(step, trajectories, per_policy, times)
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from areal_agents.config import TimelineConfig
from areal_agents.engines.base import InferenceEngine
from areal_agents.rollout.controller import RolloutController
from areal_agents.rollout.episodes import RolloutLedger
from areal_agents.rollout.gateway.live import LiveSource
from areal_agents.trainers.metrics_writer import MetricsWriter, prefixed
from areal_agents.trainers.overlong import is_truncated, truncated_fraction
from areal_agents.trainers.policy import SHARED
from areal_agents.trainers.timeline_log import TimelineLog
from areal_agents.types import Trajectory

# an update's figures that `trainer_perf` logs
_TRAINER_PERF = ("model_flops", "peak_flops", "trained_tokens", "computed_tokens")
_COUNTERS = ("prefix_hit_tokens", "prefill_tokens", "busy_seconds", "generated_tokens", "decode_steps")


@dataclass(kw_only=True)
class StepTimes:
    """``perf_counter`` times of one step: its start, its batch's last group in hand (``rollout_end``), its
    weights pushed (``end``); ``waited``: seconds the trainer sat idle for rollouts. Named, never positional:
    four floats in a row are too easy to swap."""

    start: float
    rollout_end: float
    end: float
    waited: float
    push: float = 0.0  # seconds the weight pushes took (in ``train``)
    pushed_bytes: float = 0.0  # what they moved, when the weight sync says (`WeightSync.last_push`)

    @property
    def train(self) -> float:
        """The step's time less the waits for rollouts."""
        return self.end - self.start - self.waited


@dataclass
class Totals:
    """Sums over the run's training steps (evaluations excluded)."""

    trained_samples: int = 0
    consumed_samples: int = 0
    truncated_samples: int = 0  # of the consumed: a generation stopped at its budget, or out of context
    generated_tokens: int = 0
    rollout_seconds: float = 0.0
    train_seconds: float = 0.0
    step_seconds: float = 0.0
    engine_busy_seconds: float = 0.0


class EngineUse:
    """An engine's counters since the last `read`, as ``engine/`` metrics: the share of context tokens its
    prefills took from the prefix cache, of the time it was busy, its rows per decode step."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.reports = False  # whether the engine has counters to read
        self.seen: dict[str, float] = {}

    async def read(self) -> tuple[dict[str, float], float]:
        """The metrics since the last read (``{}`` for an engine without counters) and its busy seconds."""
        counters, now = await self.engine.counters(), time.perf_counter()
        if not all(k in counters for k in _COUNTERS):
            return {}, 0.0
        self.reports = True
        new = {k: float(counters[k]) for k in _COUNTERS} | {"time": now}
        d = {k: v - self.seen.get(k, 0.0) for k, v in new.items()}
        self.seen = new
        return {
            "engine/prefix_hit_rate": d["prefix_hit_tokens"] / max(d["prefix_hit_tokens"] + d["prefill_tokens"], 1),
            "engine/busy_fraction": d["busy_seconds"] / max(d["time"], 1e-9),
            "engine/rows_per_decode_step": d["generated_tokens"] / max(d["decode_steps"], 1),
        }, d["busy_seconds"]


@dataclass
class StepLog:
    """Logs each step's metrics and keeps the run's `Totals`."""

    metrics: MetricsWriter
    controller: RolloutController | LiveSource
    ledger: RolloutLedger
    env_id: str
    engine: InferenceEngine
    timeline: TimelineConfig = field(default_factory=TimelineConfig)
    run_dir: Path | None = None  # where the run's timeline is (None: log none of it)
    totals: Totals = field(default_factory=Totals)

    def __post_init__(self) -> None:
        self.engine_use = EngineUse(self.engine)
        on = self.timeline.enabled and self.run_dir is not None
        self.timeline_log = TimelineLog(self.run_dir, self.metrics, self.timeline.heatmap_every) if on else None

    async def start(self) -> None:
        """Count the engine's work from here on (the training steps' and their evaluations')."""
        await self.engine_use.read()

    async def record(
        self,
        step: int,
        trajectories: list[Trajectory],
        per_policy: dict[str, dict[str, float]],
        times: StepTimes,
    ) -> dict[str, str]:
        """Log step ``step``; add it to the totals; the few values a progress bar shows."""
        train = train_stats(per_policy)
        rollout = rollout_stats(trajectories, self.ledger, self.controller, self.env_id)
        perf = perf_stats(trajectories, train["trained_trajectories"], times) | trainer_perf(per_policy, times)
        engine, busy = await self.engine_use.read()
        t = self.totals
        t.trained_samples += int(train["trained_trajectories"])
        t.generated_tokens += sum(x.num_generated for x in trajectories)
        t.rollout_seconds += times.rollout_end - times.start
        t.train_seconds += times.train
        t.step_seconds += times.end - times.start
        t.consumed_samples += len(trajectories)
        t.truncated_samples += sum(map(is_truncated, trajectories))
        t.engine_busy_seconds += busy
        scalars = {**prefixed("rollout", rollout), **prefixed("train", train), **prefixed("perf", perf)}
        self.metrics.log(step, scalars | {"engine/version": float(self.engine.get_version())} | engine)
        self.metrics.histogram(step, "rollout/staleness", self._staleness(len(trajectories)))
        self.metrics.histogram(step, "rollout/episode_tokens", episode_lengths(trajectories))
        self.metrics.histogram(step, "rollout/episode_turns", [m.get("num_turns", 1) for m in _episodes(trajectories)])
        if self.timeline_log is not None:
            self.timeline_log.record(step)
        return {
            "reward": f"{rollout['reward_mean']:.3f}",
            "acc": f"{rollout['accuracy']:.2f}",
            "trunc": f"{rollout['truncated_fraction']:.2f}",
            # the run so far, as the summary's generated_tokens_per_s: one step's batch may be in hand before the
            # step starts (rollouts run ahead), and its own rate then divides by almost nothing
            "tok_s": f"{t.generated_tokens / max(t.rollout_seconds, 1e-9):.0f}",
        }

    def close(self) -> None:
        """The timeline's series up to now (this process's flushed first), then the TensorBoard files closed."""
        if self.timeline_log is not None:
            self.timeline_log.record(0, heatmap=False)
        self.metrics.close()

    def _staleness(self, n: int) -> list[int]:
        return self.controller.stats.staleness[-n:] or [0]


def train_stats(per_policy: dict[str, dict[str, float]]) -> dict[str, float]:
    """The policies' update stats (a separate policy's under its name) and the trajectories they trained on;
    the trainer's FLOP and memory figures go to ``perf/`` instead (`trainer_perf`)."""
    stats: dict[str, float] = {}
    for name, policy_stats in per_policy.items():
        policy_stats = {k: v for k, v in policy_stats.items() if k not in _TRAINER_PERF and not k.startswith("perf/")}
        stats |= policy_stats if name == SHARED else prefixed(name, policy_stats)
    stats["trained_trajectories"] = sum(s.get("trained_trajectories", 0.0) for s in per_policy.values())
    return stats


def rollout_stats(
    trajectories: list[Trajectory], ledger: RolloutLedger, controller: RolloutController | LiveSource, env_id: str
) -> dict[str, float]:
    """The batch's rewards, truncation and staleness, the ledger's counts and the controller's queue (the gateway's
    session counts, when it is the source)."""
    rewards = [t.reward for t in trajectories]
    staleness = controller.stats.staleness[-len(trajectories) :] or [0]
    return {
        "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
        "accuracy": float(np.mean([x >= 1.0 for x in rewards])) if rewards else 0.0,
        "generated_tokens": float(sum(t.num_generated for t in trajectories)),
        "truncated_fraction": truncated_fraction(trajectories),  # what ppo.overlong_filtering leaves out
        "episodes_failed": float(ledger.failed),
        "episodes_env_failed": float(ledger.env_failed),
        "episodes_engine_failed": float(ledger.engine_failed),
        "episodes_worker_failed": float(ledger.worker_failed),
        "episode_retries": float(controller.runner.retries),
        "episodes_rejected": float(ledger.rejected),
        "episodes_running": float(ledger.running),
        "queued_groups": float(controller.queued_groups),
        "running_groups": float(controller.running_groups),
        "staleness_mean": float(np.mean(staleness)),
        "staleness_max": float(max(staleness)),
        **episode_shape(trajectories),
        **reward_breakdown(trajectories, env_id),
        **(controller.live_stats() if isinstance(controller, LiveSource) else {}),
    }


def _episodes(trajectories: list[Trajectory]) -> list[dict[str, Any]]:
    """Each episode's (of each agent) metadata, once: the segments of an episode carry the same counts."""
    episodes: dict[tuple[str, str], dict[str, Any]] = {}
    for t in trajectories:
        episodes.setdefault((t.episode_id, t.agent_id), t.metadata)
    return list(episodes.values())


def episode_lengths(trajectories: list[Trajectory]) -> list[int]:
    """The tokens each episode (of each agent) generated, over its segments."""
    generated: dict[tuple[str, str], int] = defaultdict(int)
    for t in trajectories:
        generated[(t.episode_id, t.agent_id)] += t.num_generated
    return list(generated.values())


def episode_shape(trajectories: list[Trajectory]) -> dict[str, float]:
    """Per episode (of each agent): the trajectory segments its template rewrites made, the tool
    calls its replies made and the malformed ones (a run whose tools never fire shows 0 calls at once)."""
    episodes = _episodes(trajectories)
    if not episodes:
        return {}
    n = len(episodes)
    return {
        "segments_per_episode": sum(m.get("num_segments", 1) for m in episodes) / n,
        "tool_calls_per_episode": sum(m.get("tool_calls", 0) for m in episodes) / n,
        "tool_parse_failures": float(sum(m.get("tool_parse_failures", 0) for m in episodes)),
    }


def perf_stats(trajectories: list[Trajectory], trained: float, times: StepTimes) -> dict[str, Any]:
    """Throughput of the step's rollouts and of its update, and where its time went."""
    generated = sum(t.num_generated for t in trajectories)
    return {
        "gen_tokens_per_s": generated / max(times.rollout_end - times.start, 1e-9),
        "trained_samples_per_s": trained / max(times.train, 1e-9),
        "train_tokens_per_s": sum(len(t) for t in trajectories) / max(times.train, 1e-9),
        "rollout_wait_seconds": times.waited,
        "step_seconds": times.end - times.start,
        **gpu_utilisation(),
    }


def trainer_perf(per_policy: dict[str, dict[str, float]], times: StepTimes) -> dict[str, float]:
    """The updates' model FLOP/s and MFU (their ``model_flops`` over the step's training seconds, less the
    weight pushes, against the trainers' summed ``peak_flops``; docs/gpu.md has the count), the trainers'
    GPU memory (``perf/gpu_memory_*``, the largest), and the weight pushes' seconds and bytes."""
    seconds = max(times.train - times.push, 1e-9)
    flops = sum(s.get("model_flops", 0.0) for s in per_policy.values())
    peak = max((s.get("peak_flops", 0.0) for s in per_policy.values()), default=0.0)
    out = {"weight_sync_seconds": times.push, "weight_sync_bytes": times.pushed_bytes}
    if flops:
        out["model_tflops_per_s"] = flops / seconds / 1e12
        out |= {"mfu": flops / seconds / peak} if peak else {}
    for stats in per_policy.values():
        for key, value in stats.items():
            if key.startswith("perf/"):
                out[key[5:]] = max(out.get(key[5:], 0.0), value)
    return out


def reward_breakdown(trajectories: list[Trajectory], default_env: str) -> dict[str, float]:
    """Mean reward per env (``metadata["env"]``, else the run's env id) and of each turn; with several
    agents also per agent (``reward_agent/ID``) and per agent and turn (``reward_turn/ID/K``)."""
    by_env: dict[str, list[float]] = defaultdict(list)
    by_agent: dict[str, list[float]] = defaultdict(list)
    by_turn: dict[tuple[str, int], list[float]] = defaultdict(list)
    for t in trajectories:
        if t.metadata.get("segment", 0) != 0:
            continue  # later segments of an episode repeat its rewards
        by_env[str(t.metadata.get("env", default_env))].append(t.reward)
        by_agent[t.agent_id].append(t.reward)
        for k, r in enumerate(t.turn_rewards):
            by_turn[(t.agent_id, k + 1)].append(r)
    out = {f"reward_env/{env}": float(np.mean(v)) for env, v in by_env.items()}
    if len(by_agent) > 1:
        out |= {f"reward_agent/{a}": float(np.mean(v)) for a, v in sorted(by_agent.items())}
        return out | {f"reward_turn/{a}/{k}": float(np.mean(v)) for (a, k), v in sorted(by_turn.items())}
    return out | {f"reward_turn/{k}": float(np.mean(v)) for (_, k), v in sorted(by_turn.items())}


def gpu_utilisation() -> dict[str, float]:
    """Utilisation (%) of each visible GPU, when there is one and NVML can read it."""
    if not torch.cuda.is_available():
        return {}
    try:
        return {f"gpu{i}_utilisation": float(torch.cuda.utilization(i)) for i in range(torch.cuda.device_count())}
    except Exception:  # noqa: BLE001  (no pynvml / NVML: skip rather than fail a run over a metric)
        return {}


def dump_trajectories(path: Path, trajectories: list[Trajectory]) -> None:
    """The step's training data as JSONL, one trajectory a line (tokens, masks, logprobs, versions, rewards)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for t in trajectories:  # the fields as they are (dataclasses.asdict's deep copy took 6x as long)
            row = {field.name: getattr(t, field.name) for field in dataclasses.fields(t)}
            row["metadata"] = json.loads(json.dumps(t.metadata, default=str))
            f.write(json.dumps(row) + "\n")
