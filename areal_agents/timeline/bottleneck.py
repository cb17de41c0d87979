"""`bottleneck_report`: where a run's wall time went, how idle each worker was, what bound the run and the one
config change most likely to help, read from its timeline (and its ``config.json`` for the keys' values).

The bound comes from the driver's spans: the phase that took the most of the steps' time (waiting for
rollouts, updating, pushing weights, evaluating, checkpointing) when it took clearly more than the next
(1.5x), else ``balanced``; time in no phase at 1.5x the top phase's is ``driver overhead``. A run that
waited for rollouts is then split by what its episodes spent their time on: generating, or in env calls
(from the ``episodes`` spans; the workers' busy shares while the trainer waited when there are none), or
scoring rewards.

Example::

    report = bottleneck_report("runs/arith/rl")
    print("\\n".join(report.lines()))   # bound: training ... advice: lower ppo.ppo_epochs ...
    report.to_json()                    # the same, for the dashboard
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from areal_agents.timeline.reader import RunTimeline, Span, read_timeline

PHASES = {  # driver span -> its name in the report
    "rollout_wait": "rollout wait",
    "update": "training",
    "weight_push": "weight sync",
    "eval": "eval",
    "checkpoint": "checkpoint",
}
BOUNDS = {  # the driver phase that dominates -> the bound (rollout_wait is split further)
    "update": "training",
    "weight_push": "weight sync",
    "eval": "eval",
    "checkpoint": "checkpoint",
}
DOMINANCE = 1.5  # the top phase must take this many times the next one's time, else the run is balanced


@dataclass
class Report:
    """A run's time and its bound. Shares are fractions (0..1) of ``wall_s``, the span from the first step's
    start to the last step's end (the whole timeline when the run recorded no steps)."""

    run_dir: str
    wall_s: float
    steps: int
    stopped_s: float = 0.0  # stops left out of wall_s: a resumed run's time between its sessions
    time: dict[str, float] = field(default_factory=dict)  # phase -> share of wall_s ("other": in no phase)
    episode_time: dict[str, float] = field(default_factory=dict)  # generate / env / other -> share of episode time
    busy: dict[str, float] = field(default_factory=dict)  # worker -> busy share over wall_s
    busy_while_waiting: dict[str, float] = field(default_factory=dict)  # worker -> busy share during rollout waits
    queues_while_waiting: dict[str, float] = field(default_factory=dict)  # gauge -> its mean during rollout waits
    bound: str = "unknown"  # rollout/generation, training, env, reward, weight sync, eval, checkpoint, driver
    # overhead (the time in no phase), balanced
    key: str = ""  # the config key the advice names
    advice: str = ""

    @property
    def idle(self) -> dict[str, float]:
        """Each worker's idle share of the run."""
        return {w: round(1.0 - b, 3) for w, b in self.busy.items()}

    def lines(self) -> list[str]:
        """The report for a terminal."""
        stopped = f"; {self.stopped_s:.0f} s stopped, left out" if self.stopped_s else ""
        out = [f"where the time went ({self.wall_s:.1f} s, {self.steps} steps{stopped}):"]
        shown = {k: v for k, v in self.time.items() if v > 0 or k in ("rollout wait", "training", "weight sync")}
        out += [f"  {name:<13} {share:>4.0%}  {'#' * round(share * 30)}".rstrip() for name, share in shown.items()]
        for role, label in (("env", "env calls"), ("reward", "reward")):
            shares = [b for w, b in self.busy.items() if _role(w) == role]
            if shares:  # the busiest worker: a pool's first slot is busy whenever any call runs
                out.append(f"  {label:<13} {max(shares):>4.0%}  of the time one ran (overlaps the phases above)")
        if self.episode_time:
            parts = ", ".join(f"{_EPISODE_LABELS.get(k, k)} {v:.0%}" for k, v in self.episode_time.items())
            out.append(f"episodes spent their time: {parts}")
        if self.busy:
            out.append("idle share: " + ", ".join(f"{w} {i:.0%}" for w, i in _rows(self.idle).items()))
        out += [f"bound: {self.bound}", f"advice: {self.advice}"]
        return out

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the dashboard's)."""
        return {**asdict(self), "idle": self.idle}


_EPISODE_LABELS = {"generate": "generating", "env": "in env resets and steps", "other": "elsewhere"}


def bottleneck_report(run: str | Path | RunTimeline, config: dict[str, Any] | None = None) -> Report:
    """The report of ``run`` (a run dir, or its timeline with ``config``: the run's config as a dict, whose
    values the advice quotes; read from ``RUN/config.json`` for a run dir)."""
    run_dir = ""
    if not isinstance(run, RunTimeline):
        run_dir = str(run)
        config = read_run_config(Path(run)) if config is None else config
        run = read_timeline(run)
    cfg = _Config(config or {})
    driver = [s for s in run.spans if s.track == "driver"]
    steps = [s for s in driver if s.name == "step"]
    w0, w1 = (min(s.start for s in steps), max(s.end for s in steps)) if steps else (run.start, run.end)
    stops = _stops(steps)
    report = Report(run_dir, round(max(w1 - w0 - _union(stops), 0.0), 3), len(steps), round(_union(stops), 3))
    if report.wall_s <= 0:
        report.advice = "no timeline recorded: nothing to say"
        return report
    report.time = _phase_shares(driver, _windows(w0, w1, stops), report.wall_s)
    window = _bins_in(run, w0, w1) & ~_bins_covered(run, stops)
    waiting = _bins_covered(run, [(s.start, s.end) for s in driver if s.name == "rollout_wait"]) & window
    report.busy = {w: _mean(v[window]) for w, v in run.busy.items() if np.isfinite(v[window]).any()}
    during = waiting if waiting.any() else window
    report.busy_while_waiting = {w: _mean(v[during]) for w, v in run.busy.items() if np.isfinite(v[during]).any()}
    report.queues_while_waiting = {g: _mean(v[during]) for g, v in run.gauges.items() if np.isfinite(v[during]).any()}
    report.episode_time = _episode_shares(run.spans, w0, w1)
    report.bound = _bound(report)
    advise = ADVICE[report.bound] if any(report.time[p] for p in PHASES.values()) else _advise_without_steps
    report.key, report.advice = advise(report, cfg, run)
    return report


def report_lines(run_dir: str | Path) -> list[str]:
    """The report's lines for the end of a training run; ``[]`` for a run with no timeline; never raises."""
    try:
        report = bottleneck_report(run_dir)
    except Exception as e:  # noqa: BLE001  (a report must never fail the run it reports on)
        return [f"bottleneck report: not available ({type(e).__name__}: {e})"]
    return report.lines() if report.wall_s > 0 else []


# -- measuring -----------------------------------------------------------------------------------------------


def _union(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``intervals``."""
    total, reach = 0.0, -np.inf
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _stops(steps: list[Span]) -> list[tuple[float, float]]:
    """A resumed run's stops: from one session's last step to the next session's first (each session's driver
    is a process of its own), left out of the run's time."""
    sessions: dict[str, tuple[float, float]] = {}
    for s in steps:
        a, b = sessions.get(s.process, (s.start, s.end))
        sessions[s.process] = (min(a, s.start), max(b, s.end))
    ordered = sorted(sessions.values())
    return [(prev[1], nxt[0]) for prev, nxt in zip(ordered, ordered[1:]) if nxt[0] > prev[1]]


def _windows(w0: float, w1: float, stops: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``[w0, w1]`` less the stops."""
    out, start = [], w0
    for a, b in sorted(stops):
        out.append((start, a))
        start = max(start, b)
    return [*out, (start, w1)]


def _phase_shares(driver: list[Span], windows: list[tuple[float, float]], wall: float) -> dict[str, float]:
    """Each phase's share of ``wall`` seconds within ``windows`` (overlapping spans of one phase counted once)
    and the rest's."""
    clipped = {
        name: [
            (max(s.start, a), min(s.end, b))
            for s in driver
            if s.name == name
            for a, b in windows
            if s.end > a and s.start < b
        ]
        for name in PHASES
    }
    out = {label: round(_union(clipped[name]) / wall, 3) for name, label in PHASES.items()}
    out["other"] = round(max(1.0 - _union([iv for ivs in clipped.values() for iv in ivs]) / wall, 0.0), 3)
    return out


def _bins_in(run: RunTimeline, w0: float, w1: float) -> np.ndarray:
    """Mask of the bins that overlap ``[w0, w1]``."""
    starts = run.start + np.arange(run.bins) * run.dt
    return (starts + run.dt > w0) & (starts < w1)


def _bins_covered(run: RunTimeline, intervals: list[tuple[float, float]]) -> np.ndarray:
    """Mask of the bins that ``intervals`` (wall-clock ``(start, end)``) cover at least half of."""
    covered = np.zeros(run.bins)
    for start, end in intervals:
        first = max(int((start - run.start) // run.dt), 0)
        last = min(int((end - run.start) // run.dt), run.bins - 1)
        for i in range(first, last + 1):
            a = run.start + i * run.dt
            covered[i] += max(min(end, a + run.dt) - max(start, a), 0.0)
    return covered >= run.dt / 2


def _mean(values: np.ndarray) -> float:
    return round(float(np.nanmean(values)), 3)


def _episode_shares(spans: list[Span], w0: float, w1: float) -> dict[str, float]:
    """What episodes spent their time on, as shares of the episodes' summed lengths: ``generate``, ``env``
    (``env_step`` and ``env_reset`` calls) and ``other`` (queued, the agent's own work); ``{}`` without them."""
    seen = [s for s in spans if s.track == "episodes" and s.end > w0 and s.start < w1]
    total = {"episode": 0.0, "generate": 0.0, "env": 0.0}
    for s in seen:
        kind = "env" if s.name.startswith("env_") else s.name
        if kind in total:
            total[kind] += s.end - s.start
    whole = max(total["episode"], total["generate"] + total["env"])
    if whole <= 0:
        return {}
    shares = {"generate": total["generate"] / whole, "env": total["env"] / whole}
    shares["other"] = max(1.0 - shares["generate"] - shares["env"], 0.0)
    return {k: round(v, 3) for k, v in shares.items()}


def _rows(shares: dict[str, float]) -> dict[str, float]:
    """Numbered workers of one kind (a pool's slots ``env/pool/0..N``) as one row ``env/pool (N+1)``: their mean."""
    groups: dict[str, list[float]] = {}
    for worker, share in shares.items():
        groups.setdefault(re.sub(r"/\d+$", "", worker), []).append(share)
    return {(k if len(v) == 1 else f"{k} ({len(v)})"): float(np.mean(v)) for k, v in groups.items()}


def _role(worker: str) -> str:
    """A worker's kind from its name (``engine/hf``, ``driver:trainer/default``, ``gpu0``): engine, trainer, env,
    reward, gpu or other."""
    m = re.search(r"(?:^|:)(engine|trainer|env|reward)/", worker)
    if m:
        return m.group(1)
    return "gpu" if re.search(r"(?:^|:)gpu\d+$", worker) else "other"


def _group(shares: dict[str, float], role: str) -> float:
    """The mean busy share of the workers of ``role`` (-1 when it has none)."""
    values = [v for w, v in shares.items() if _role(w) == role]
    return float(np.mean(values)) if values else -1.0


def _workers(shares: dict[str, float], role: str, one: str = "was", several: str = "were") -> str:
    """The workers of ``role`` named for a sentence, with its verb: ``engine/hf was``, ``2 engine workers were``."""
    names = [w for w in shares if _role(w) == role]
    return f"{names[0]} {one}" if len(names) == 1 else f"{len(names)} {role} workers {several}"


# -- judging -------------------------------------------------------------------------------------------------


def _bound(r: Report) -> str:
    """The bound of the run (see the module docstring)."""
    phases = {k: r.time.get(v, 0.0) for k, v in PHASES.items()}
    ranked = sorted(phases, key=phases.__getitem__, reverse=True)
    top, second = phases[ranked[0]], phases[ranked[1]]
    if top <= 0:
        return _bound_by_workers(r)
    if r.time.get("other", 0.0) >= DOMINANCE * top:
        return "driver overhead"
    if top < DOMINANCE * second:
        return "balanced"
    if ranked[0] != "rollout_wait":
        return BOUNDS[ranked[0]]
    engine, env, reward = (_group(r.busy_while_waiting, role) for role in ("engine", "env", "reward"))
    if reward >= 0.5 and reward > max(engine, env):
        return "reward"
    if r.episode_time:
        return "env" if r.episode_time["env"] > r.episode_time["generate"] else "rollout/generation"
    return "env" if env > engine else "rollout/generation"


def _bound_by_workers(r: Report) -> str:
    """Without driver phases: the busiest kind of worker when it was busy most of the time."""
    groups = {role: _group(r.busy, role) for role in ("engine", "trainer", "env", "reward")}
    role = max(groups, key=groups.__getitem__)
    names = {"engine": "rollout/generation", "trainer": "training", "env": "env", "reward": "reward"}
    return names[role] if groups[role] >= 0.8 else "balanced"


class _Config:
    """The run's config as a nested dict; `get` a dotted key's value (None when the run did not say)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def get(self, key: str) -> Any:
        node: Any = self.data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def now(self, key: str) -> str:
        value = self.get(key)
        return "" if value is None else f" (now {value})"


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """``RUN/config.json`` as a dict (``{}`` when missing or unreadable): the values the advice quotes."""
    try:
        return json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _advise_generation(r: Report, cfg: _Config, run: RunTimeline) -> tuple[str, str]:
    wait, update = r.time.get("rollout wait", 0.0), r.time.get("training", 0.0)
    engine = _group(r.busy_while_waiting, "engine")
    said = f"the trainer waited for rollouts {_pct(wait)} of the run"
    if engine < 0:
        return "engine.num_servers", f"{said}: raise engine.num_servers{cfg.now('engine.num_servers')}"
    who = _workers(r.busy_while_waiting, "engine")
    if engine < 0.6:
        key = "rollout.max_concurrent_rollouts"
        why = f"{said} while {who} busy only {_pct(engine)} of that time: raise {key}{cfg.now(key)}"
        return key, why + " so that more episodes generate at once and fill the engine"
    if cfg.get("rollout.max_staleness") == 0 and update >= 0.1:
        key = "rollout.max_staleness"
        why = f"{said} while {who} busy {_pct(engine)} of that wait, and stood still during updates ({_pct(update)})"
        return key, f"{why}: raise {key}{cfg.now(key)} to 1 so generation runs on during updates"
    key = "engine.num_servers"
    return (
        key,
        f"{said} while {who} busy {_pct(engine)} of that wait: raise {key}{cfg.now(key)} for more generation",
    )


def _advise_training(r: Report, cfg: _Config, run: RunTimeline) -> tuple[str, str]:
    update, wait = r.time.get("training", 0.0), r.time.get("rollout wait", 0.0)
    engine = _group(r.busy, "engine")
    said = f"updates took {_pct(update)} of the run"
    if engine >= 0:
        said += f" while {_workers(r.busy, 'engine', 'sat', 'sat')} idle {_pct(1 - engine)} of the run"
    if cfg.get("rollout.max_staleness") == 0 and wait >= 0.2:
        key = "rollout.max_staleness"
        return key, f"{said}: raise {key}{cfg.now(key)} to 1 so the next batch generates during the update"
    for key in ("ppo.ppo_epochs", "ppo.num_minibatches"):
        value = cfg.get(key)
        if isinstance(value, int) and value > 1:
            return key, f"{said}: lower {key}{cfg.now(key)} (each pass over the batch is a full forward/backward)"
    key = "ppo.micro_batch_tokens"
    return key, f"{said}: raise {key}{cfg.now(key)} (fewer, fuller forward/backward passes) or ppo.nproc_per_node"


def _advise_env(r: Report, cfg: _Config, run: RunTimeline) -> tuple[str, str]:
    wait, share = r.time.get("rollout wait", 0.0), r.episode_time.get("env")
    said = f"the trainer waited for rollouts {_pct(wait)} of the run" + (
        f", and episodes spent {_pct(share)} of their time in env calls" if share is not None else ""
    )
    workers, in_flight = cfg.get("env.workers"), _queue(r, "env/steps_in_flight")
    if isinstance(workers, int) and in_flight is not None and in_flight >= 0.8 * workers:
        key = "env.workers"
        busy = f", with {in_flight:.1f} env steps in flight on average for {workers} env workers"
        return key, f"{said}{busy}: raise {key}{cfg.now(key)}"
    key = "rollout.max_concurrent_rollouts"
    return key, f"{said}: make the env's step faster, or raise {key}{cfg.now(key)} to overlap more env steps"


def _advise_reward(r: Report, cfg: _Config, run: RunTimeline) -> tuple[str, str]:
    busy = _group(r.busy_while_waiting, "reward")
    key = "env.workers"
    why = f"the reward service was busy {_pct(busy)} while the trainer waited for rollouts"
    return key, f"{why}: rewards are scored within env calls, raise {key}{cfg.now(key)} or use a cheaper reward"


def _advise_push(r: Report, cfg: _Config, run: RunTimeline) -> tuple[str, str]:
    pushes = [s.end - s.start for s in run.spans if s.track == "driver" and s.name == "weight_push"]
    said = f"weight pushes took {_pct(r.time.get('weight sync', 0.0))} of the run ({np.mean(pushes):.2f} s each)"
    if cfg.get("engine.weight_sync") in ("auto", "disk", None):
        key = "engine.weight_sync"
        return key, f"{said}: set {key}=broadcast{cfg.now(key)} to send tensors instead of files"
    key = "engine.weight_sync_bucket_mb"
    return key, f"{said}: raise {key}{cfg.now(key)} (fewer, larger buckets)"


def _advise_eval(r: Report, cfg: _Config, run: RunTimeline) -> tuple[str, str]:
    key = "eval.every" if cfg.get("eval.every") else "eval.num_problems"
    change = "raise" if key == "eval.every" else "lower"
    return key, f"evaluation took {_pct(r.time.get('eval', 0.0))} of the run: {change} {key}{cfg.now(key)}"


def _advise_checkpoint(r: Report, cfg: _Config, run: RunTimeline) -> tuple[str, str]:
    key = "save_every_minutes" if cfg.get("save_every_minutes") else "save_every"
    return key, f"checkpoints took {_pct(r.time.get('checkpoint', 0.0))} of the run: raise {key}{cfg.now(key)}"


def _advise_overhead(r: Report, cfg: _Config, run: RunTimeline) -> tuple[str, str]:
    said = f"{_pct(r.time.get('other', 0.0))} of the run was in none of the driver's phases (its own work between them)"
    every = cfg.get("timeline.heatmap_every")
    if isinstance(every, int) and every > 0:
        key = "timeline.heatmap_every"
        return (
            key,
            f"{said}: raise {key}{cfg.now(key)}, the heatmap drawn between steps, or see the trace's driver track",
        )
    return "", f"{said}: see the trace's driver track for what runs between steps"


def _advise_balanced(r: Report, cfg: _Config, run: RunTimeline) -> tuple[str, str]:
    wait, update = r.time.get("rollout wait", 0.0), r.time.get("training", 0.0)
    said = f"no single bound (rollout wait {_pct(wait)}, training {_pct(update)})"
    if cfg.get("rollout.max_staleness") == 0 and min(wait, update) >= 0.2:
        key = "rollout.max_staleness"
        return key, f"{said}: raise {key}{cfg.now(key)} to 1 so rollouts and updates overlap"
    key = "engine.num_servers"
    return key, f"{said}: both sides are busy; grow both ({key}{cfg.now(key)} and ppo.nproc_per_node)"


def _advise_without_steps(r: Report, cfg: _Config, run: RunTimeline) -> tuple[str, str]:
    """A timeline with no driver phases (not a training run's driver): judged by its workers alone."""
    role = {"rollout/generation": "engine", "training": "trainer", "env": "env", "reward": "reward"}.get(r.bound)
    if role is None:
        return "", "no training steps recorded and no worker was busy most of the time: nothing to change"
    key = {"engine": "engine.num_servers", "trainer": "ppo.micro_batch_tokens"}.get(role, "env.workers")
    said = f"no training steps recorded; {_workers(r.busy, role)} busy {_pct(_group(r.busy, role))} of the time"
    return key, f"{said}: raise {key}{cfg.now(key)}"


def _queue(r: Report, name: str) -> float | None:
    """A gauge's mean while the trainer waited for rollouts (any process's; None when none recorded it)."""
    return next((v for k, v in r.queues_while_waiting.items() if k == name or k.endswith(":" + name)), None)


ADVICE: dict[str, Callable[[Report, _Config, RunTimeline], tuple[str, str]]] = {
    "rollout/generation": _advise_generation,
    "training": _advise_training,
    "env": _advise_env,
    "reward": _advise_reward,
    "weight sync": _advise_push,
    "eval": _advise_eval,
    "checkpoint": _advise_checkpoint,
    "driver overhead": _advise_overhead,
    "balanced": _advise_balanced,
}
