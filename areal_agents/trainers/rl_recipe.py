"""`areal-agents train`: RL with decoupled PPO, read top to bottom.

Each step: roll out ``batch_size`` prompts x ``group_size`` episodes with the engine -> one PPO update
on the trainer's copy of the policy -> push the new weights to the engine (version + 1). Held-out
greedy accuracy is measured before and after (and every ``eval.every`` steps).

Where the run's parts execute is the `Launcher`'s business (`areal_agents.trainers.policy_api`: this
machine, or a Ray cluster), and how a policy trains and reaches its engine is its `TrainablePolicy`'s:
the loop below names neither a concrete engine nor a concrete trainer.

Example::

    from areal_agents.cluster import open_launcher

    summary = run_train(cfg, launcher=open_launcher(cfg))
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from areal_agents.agents.factory import make_rollout_agent
from areal_agents.config import TrainConfig
from areal_agents.envs.runtime.backends import EnvBackend
from areal_agents.errors import ConfigError, RunHalted
from areal_agents.models.loading import check_max_new_tokens, load_tokenizer, pad_token_id
from areal_agents.progress import plural, progress_bar
from areal_agents.rollout.controller import Group, RolloutController, has_reward_variance
from areal_agents.rollout.episodes import EpisodeFn
from areal_agents.rollout.failures import FailureLog
from areal_agents.rollout.gateway.live import LiveSource, open_live_source
from areal_agents.rollout.held_out import evaluate
from areal_agents.timeline import close_timeline, timeline
from areal_agents.timeline.bottleneck import report_lines
from areal_agents.trainers.batch_update import TrainedBatch, take_and_train, trajectories_of
from areal_agents.trainers.checkpoint import checkpoints, load_trainer_state
from areal_agents.trainers.interrupt import Interrupt
from areal_agents.trainers.local_launcher import LocalLauncher
from areal_agents.trainers.metrics_writer import MetricsWriter, prefixed
from areal_agents.trainers.policy import SHARED
from areal_agents.trainers.policy_api import Launcher, TrainablePolicy, TrainSpec, policy_starts
from areal_agents.trainers.ppo import streamable
from areal_agents.trainers.resume import check_resume_config, forget_after
from areal_agents.trainers.run_release import RunSessions, close_in_loop, stop_after_loop
from areal_agents.trainers.run_start import (
    held_out_seeds,
    open_checked_backend,
    open_run_timeline,
    prepare_run_dir,
    seed_everything,
)
from areal_agents.trainers.run_state import RunState, model_dir, restore_policies, save_run
from areal_agents.trainers.run_summary import write_summary
from areal_agents.trainers.step_metrics import StepLog, StepTimes, dump_trajectories
from areal_agents.types import SamplingParams, Trajectory


def run_train(
    cfg: TrainConfig,
    progress: bool = True,
    resume: bool = False,
    allow_config_change: bool = False,
    launcher: Launcher | None = None,
) -> dict[str, Any]:
    """Run RL as configured (``resume``: from the run's newest checkpoint, with the run's saved config
    less `FREE_KEYS` unless ``allow_config_change``) on ``launcher`` (default: this machine; for
    ``launcher: ray``, ``areal_agents.cluster.open_launcher(cfg)``); return the summary also written to
    ``run_dir/summary.json``. SIGINT or SIGTERM save the last finished step first (`Interrupt`). Every exit
    stops the servers and processes the run started and closes its sessions on env servers it did not
    start; a start after a kill closes what the killed run left open (`RunSessions`)."""
    if launcher is None and cfg.launcher != "local":
        raise ConfigError(
            f"launcher={cfg.launcher}: pass run_train(..., launcher=open_launcher(cfg)) (areal_agents.cluster)"
        )
    found, changes = _checkpoint_to_resume(cfg, resume, allow_config_change)
    sessions = RunSessions.claim(cfg.run_dir, cfg)  # before anything is written: refused if a run holds run_dir
    tokenizer = load_tokenizer(cfg.model.path)
    starts = policy_starts(cfg)  # policy name -> its starting model and adapter
    for start in starts.values():  # before any rollout: a budget past the model's context is a config error
        check_max_new_tokens(cfg.rollout.max_new_tokens, start.path, "rollout.max_new_tokens")
    run_dir = prepare_run_dir(cfg.run_dir, cfg)
    seed_everything(cfg.seed)
    state = None
    if found is not None:
        state = load_trainer_state(found)  # also puts the global RNGs back
        print(f"resuming from {found} (step {state['step']}, policy version {state['version']})")
        if changes:
            print(f"with config changes (--allow-config-change): {'; '.join(changes)}")
    forget_after(run_dir, state["step"] if state else 0)  # steps after the checkpoint are redone, and logged anew
    launcher = launcher if launcher is not None else LocalLauncher(cfg, run_dir)
    spec = TrainSpec.of(cfg, pad_token_id(tokenizer))
    policies: dict[str, TrainablePolicy] = {}
    # This thread runs the event loop (agents, envs), not tensors: one intra-op thread, so the torch
    # work it does start (weight swaps) adds no OpenMP team beside the trainer's and the engine's.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with Interrupt() as interrupt:  # SIGTERM before the loop runs: SystemExit(143), servers stopped
        try:
            sessions.hold()
            open_run_timeline(run_dir, cfg.timeline)  # before any engine, server or trainer: they record into it
            launcher.start()
            for name, start in starts.items():
                path = str(found / model_dir(name)) if found else start.path
                policies[name] = launcher.open_policy(name, path, start.path, replace(spec, lora=start.lora))
            adapters = frozenset(name for name, start in starts.items() if start.lora is not None)
            run = Run(cfg, tokenizer, policies, launcher, run_dir, interrupt, progress, state, found, adapters)
            return interrupt.run(_train(run, sessions))
        finally:
            with interrupt.stopping():  # a signal waits: a stop cut short would leave servers or sessions
                stop_after_loop(policies.values(), launcher, sessions)
            close_timeline()
            torch.set_num_threads(threads)


@dataclass(frozen=True)
class Run:
    """One RL run's parts, opened by `run_train` and handed down the loop whole."""

    cfg: TrainConfig
    tokenizer: PreTrainedTokenizerBase
    policies: dict[str, TrainablePolicy]  # by name: the shared one (`SHARED`), or one per agent id
    launcher: Launcher
    run_dir: Path
    interrupt: Interrupt
    progress: bool  # show a progress bar
    resumed: dict[str, Any] | None  # the trainer state of the checkpoint resumed from (None: a new run)
    checkpoint: Path | None  # that checkpoint (each policy reads its own train state from it)
    adapters: frozenset[str]  # the policies that train a LoRA adapter (their engine starts without it)

    @property
    def main(self) -> TrainablePolicy:
        """The policy whose engine's version is the run's (all advance together)."""
        return next(iter(self.policies.values()))


def _checkpoint_to_resume(cfg: TrainConfig, resume: bool, allow_change: bool) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of the run when resuming, and the config's allowed changes from the run's."""
    if not resume:
        return None, []
    found = checkpoints(cfg.run_dir)
    if not found:
        raise ConfigError(f"--resume: no complete checkpoint under {Path(cfg.run_dir) / 'checkpoints'}")
    return found[-1], check_resume_config(cfg.run_dir, cfg, allow_change)


async def _train(run: Run, sessions: RunSessions) -> dict[str, Any]:
    cfg, policies = run.cfg, run.policies
    # a bad env id or kwargs fail here
    backend = await open_checked_backend(cfg.env, cfg.eval, run.launcher.env_backend(), owner=sessions.owner)
    r = cfg.rollout
    engine = policies[SHARED].engine if SHARED in policies else {name: p.engine for name, p in policies.items()}
    agents = []  # the sampling agent, and the same agent logic decoding greedily for evaluation
    try:
        await _serve_starting_weights(run)
        for sampling in (
            None,
            SamplingParams(r.max_new_tokens, temperature=cfg.eval.temperature, top_p=cfg.eval.top_p),
        ):
            agents.append(make_rollout_agent(r, engine, run.tokenizer, sampling))
        sampler, greedy = agents
        position = RunState.restore(cfg.seed, run.resumed)
        live = await _open_live_source(run, position) if r.source == "gateway" else None
        if live is not None:
            agents.append(live)  # closed with the agents on every exit path: the gateway stops
        return await _train_loop(run, backend, sampler, greedy, position, live)
    except asyncio.CancelledError:
        if not run.interrupt.caught():
            raise
        await run.interrupt.stop()  # the loop's handler: save the last finished step; raises Interrupted
    finally:
        with run.interrupt.stopping():
            await close_in_loop(agents, sessions, backend, [p.engine for p in policies.values()])


async def _serve_starting_weights(run: Run) -> None:
    """The policies' train state from the checkpoint resumed from, and the engines serving its weights under
    its version: an engine opened on the checkpoint's model learns the version; a LoRA policy's engine,
    opened on the base model alone, is pushed the adapter (at version 0 too, for a new run)."""
    state = run.resumed
    if run.checkpoint is not None:
        restore_policies(run.policies, run.checkpoint)
    version = state["version"] if state is not None else 0
    for name, policy in run.policies.items():
        if name in run.adapters:
            await policy.weight_sync.push(policy, version)
        elif state is not None:
            await policy.weight_sync.announce(version)


async def _open_live_source(run: Run, position: RunState) -> LiveSource:
    """``rollout.source=gateway``: the gateway serving the run's one policy, counting in the run's ledger."""
    engine, g, r = run.policies[SHARED].engine, run.cfg.gateway, run.cfg.rollout
    return await open_live_source(g, r, engine, run.tokenizer, position.ledger, run.run_dir, position.data.position)


async def _train_loop(
    run: Run, backend: EnvBackend, agent: Any, greedy: Any, position: RunState, live: LiveSource | None
) -> dict[str, Any]:
    """The steps, from ``position``, on batches from the controller or the gateway (``live``)."""
    cfg, r, policies, interrupt, main = run.cfg, run.cfg.rollout, run.policies, run.interrupt, run.main
    if run.resumed:
        print(f"prompts {position.data.describe()}")  # the groups not consumed, in order: none twice, none skipped
    eval_seeds = await held_out_seeds(backend, cfg.eval)
    # TensorBoard hides what an earlier run logged from here on (a resumed run redoes those steps)
    metrics = MetricsWriter(run.run_dir / "tensorboard", purge_step=position.first_step if run.resumed else 0)
    failures = FailureLog(run.run_dir / "failures.log")  # failed episodes: rate-limited lines, a traceback per cause
    episodes_at = run.launcher.episode_runner(main)
    controller = live or _controller(cfg, agent, backend, position, main.engine.get_version, episodes_at, failures)
    log = StepLog(metrics, controller, position.ledger, cfg.env.id, main.engine, cfg.timeline, run.run_dir)
    saver = _Saver(run, controller, metrics, saved=position.first_step - 1)
    interrupt.on_stop = saver.save_on_interrupt

    async def run_eval(step: int) -> float:
        make_env = lambda: backend.make(**cfg.eval.env_kwargs)  # noqa: E731
        n, retries = cfg.eval.n_samples, r.max_retries
        samples = run.run_dir / "eval_samples" / f"step_{step}.jsonl"  # beside the trajectories, when dumped
        dump = functools.partial(dump_trajectories, samples) if r.dump_trajectories else None
        with timeline().span("driver", "eval", keep=True, step=step):
            result = await evaluate(
                greedy, make_env, eval_seeds, r.max_concurrent_rollouts, n,
                max_retries=retries, failures=failures, dump=dump,
            )  # fmt: skip
        metrics.log(step, prefixed("eval", result))
        position.record_accuracy(step, result["accuracy"])  # the curve; a checkpoint of this step keeps it
        saver.keep_curve(position.accuracy_curve)
        return result["accuracy"]

    start = time.perf_counter()
    try:  # a run that cannot make progress (RunHalted) stops, keeping its last finished step
        if position.accuracy_before is None:
            await run_eval(0)
        print(
            f"held-out greedy accuracy before RL: {position.accuracy_before:.1%} ({plural(len(eval_seeds), 'problem')})"
        )
        # a local trainer can start on a batch's finished groups while its last generate (the same gradient)
        stream = cfg.ppo.stream_updates and r.max_staleness > 0 and streamable(cfg.ppo)
        stream = stream and all(p.streams for p in policies.values())
        await log.start()  # the engine's counters from here on: the training steps' (and their evals')
        bar = progress_bar(total=cfg.steps, initial=saver.done, desc="rl", enabled=run.progress)
        for step in range(position.first_step, cfg.steps + 1):
            t0, began = time.perf_counter(), time.time()
            # episodes keep running while we train (max_staleness > 0)
            batch = await take_and_train(controller, policies, position.generator, interrupt, stream)
            trajectories = trajectories_of(batch.groups)
            _record_data(run.run_dir, step, batch.groups, trajectories if r.dump_trajectories else None)
            spent = log.totals.step_seconds + time.perf_counter() - t0
            last = step == cfg.steps or bool(cfg.max_train_minutes and spent >= 60 * cfg.max_train_minutes)
            if last:
                controller.pause()  # the last update needs no more rollouts
            times = await _push_weights(policies, controller, t0, batch)  # version + 1
            timeline().add_span("driver", "step", began, time.time(), keep=True, step=step)
            bar.set_postfix(**await log.record(step, trajectories, batch.stats, times), refresh=False)
            bar.update()
            saver.finished(step, position.snapshot(controller.cursor, main.engine.get_version()))
            interrupt.release()  # a signal that came while the step trained stops the run here
            if cfg.eval.every and step % cfg.eval.every == 0 and not last:
                bar.write(f"step {step}: held-out greedy accuracy {await run_eval(step):.1%}")
            if not last:
                saver.periodic(step)
            if last:
                break
        bar.close()
        await controller.aclose()  # episodes still in flight (max_staleness > 0) end as cancelled
        if saver.done < cfg.steps:
            print(
                f"stopped after step {saver.done}: max_train_minutes={cfg.max_train_minutes:g} of training steps spent"
            )
        after = await run_eval(saver.done)
    except RunHalted:
        failures.flush()
        await saver.save_on_halt()
        raise
    ckpt = saver.save(saver.done, position.snapshot(controller.cursor, main.engine.get_version()))
    log.close()  # TensorBoard's files, the timeline's last series in them
    summary = write_summary(
        run.run_dir,
        accuracy={"before": position.accuracy_before, "after": after},
        curve=position.accuracy_curve,
        eval_problems=len(eval_seeds),
        steps=(position.first_step, saver.done),
        version=main.engine.get_version(),
        wall=time.perf_counter() - start,
        totals=log.totals,
        engine_reports=log.engine_use.reports,
        ledger=position.ledger,
        retries=controller.runner.retries,
        checkpoint=ckpt,
        launcher_stats=run.launcher.stats(),
    )
    timeline().flush()  # the driver's last bins, for the report
    for line in report_lines(run.run_dir):  # where the time went, and the one change most likely to help
        print(line)
    return summary


async def _push_weights(
    policies: dict[str, TrainablePolicy], controller: RolloutController, start: float, batch: TrainedBatch
) -> StepTimes:
    """Each policy's trained weights to its engine (version + 1), the controller told (its staleness gate
    moves on); the times of the step that started at ``start`` and trained ``batch``."""
    pushed = time.perf_counter()
    with timeline().span("driver", "weight_push", keep=True):
        for policy in policies.values():
            await policy.push_weights()
    controller.notify_version()
    end = time.perf_counter()
    moved = sum(p.weight_sync.last_push.get("weight_sync_bytes", 0.0) for p in policies.values())
    return StepTimes(
        start=start, rollout_end=batch.rollout_end, end=end, waited=batch.waited, push=end - pushed, pushed_bytes=moved
    )


def _controller(
    cfg: TrainConfig,
    agent: Any,
    backend: EnvBackend,
    run: RunState,
    get_version: Callable[[], int],
    run_episode: EpisodeFn | None,
    failures: FailureLog,
) -> RolloutController:
    """The run's rollout controller at the run's position, gating staleness by ``get_version`` (``run_episode``:
    where episodes run; None: here, by ``agent``), reporting failed episodes to ``failures``."""
    r, seed = cfg.rollout, cfg.seed

    def seed_at(index: int) -> int:
        """Prompt ``index`` of the run: a pure function of (seed, index), so a resumed run sees the same data."""
        return int(np.random.default_rng([seed, index]).integers(0, 2**31 - 1))

    return RolloutController(
        agent,
        backend.make,
        seed_at,
        batch_size=r.batch_size,
        group_size=r.group_size,
        get_version=get_version,
        max_staleness=r.max_staleness,
        max_concurrent_episodes=r.max_concurrent_rollouts,
        group_filter=has_reward_variance if r.dynamic_sampling else None,
        max_retries=r.max_retries,
        ledger=run.ledger,
        start_index=run.data.position,
        consumed=run.data.consumed,
        groups_before=(run.first_step - 1) * r.batch_size,
        run_episode=run_episode,
        max_failed_fraction=r.max_failed_fraction,
        failures=failures,
    )


@dataclass
class _Saver:
    """The run's checkpoints: every ``save_every`` steps or ``save_every_minutes``, at the end, and at a
    signal or a halt (of the last finished step, ``done``, told by `finished`)."""

    run: Run
    controller: RolloutController
    metrics: MetricsWriter
    saved: int  # the newest checkpoint's step
    last_save: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        # counts steps of the whole run (a resumed one starts at its checkpoint)
        self.done = min(self.saved, self.run.cfg.steps)  # the last step trained
        self.snap: dict[str, Any] = {}  # its `RunState.snapshot`

    def finished(self, step: int, snap: dict[str, Any]) -> None:
        """Step ``step`` finished (trained, weights pushed); ``snap`` is its `RunState.snapshot`."""
        self.done, self.snap = step, snap

    def keep_curve(self, curve: list[tuple[int, float]]) -> None:
        """A held-out evaluation of the last finished step joined the accuracy curve: its checkpoint keeps it."""
        self.snap["accuracy_curve"] = list(curve)

    def save(self, step: int, snap: dict[str, Any]) -> Path:
        run = self.run
        with timeline().span("driver", "checkpoint", keep=True, step=step):
            path = save_run(run.run_dir, step, run.policies, run.tokenizer, snap, run.cfg.keep_checkpoints)
        self.saved = step
        return path

    def periodic(self, step: int) -> None:
        every_steps = self.run.cfg.save_every and step % self.run.cfg.save_every == 0
        minutes = self.run.cfg.save_every_minutes
        if every_steps or (minutes and time.monotonic() - self.last_save >= 60 * minutes):
            self.save(step, self.snap)
            self.last_save = time.monotonic()

    async def save_on_interrupt(self) -> None:
        """A signal abandoned the step in progress (untrained): checkpoint the last finished one."""
        await self._save_last(f"stopped by {self.run.interrupt.name}")

    async def save_on_halt(self) -> None:
        """The run cannot make progress (`RunHalted`): checkpoint the last finished step; the error says why."""
        await self._save_last("halted")

    async def _save_last(self, why: str) -> None:
        await self.controller.aclose()
        self.metrics.close()
        if self.done <= self.saved:
            where = f"since the checkpoint of step {self.saved}" if self.saved > 0 else "yet"
            print(f"{why}: no step finished {where}, none written")
            return
        for policy in self.run.policies.values():  # an abandoned streamed update's backward may still be running
            await policy.wait_idle()
        path = self.save(self.done, self.snap)
        print(f"{why} after step {self.done}: checkpoint {path} (--resume continues from it)")


def _record_data(run_dir: Path, step: int, groups: list[Group], dump: list[Trajectory] | None) -> None:
    """The step's prompt order (``data_order.jsonl``), and its trajectories when ``dump`` holds them."""
    with open(run_dir / "data_order.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "prompts": [g.index for g in groups]}) + "\n")
    if dump is not None:
        dump_trajectories(run_dir / "trajectories" / f"step_{step}.jsonl", dump)
