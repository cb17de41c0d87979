"""`areal-agents train`: RL with decoupled PPO, read top to bottom.

Each step: roll out ``batch_size`` prompts x ``group_size`` episodes with the engine -> one PPO update
on the trainer's copy of the policy -> push the new weights to the engine (version + 1). Held-out
greedy accuracy is measured before and after (and every ``eval.every`` steps).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from areal_agents.agents.factory import make_rollout_agent
from areal_agents.config import TrainConfig
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.hf.process_engine import ProcessEngine
from areal_agents.engines.sglang.client import SGLangEngine
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.errors import ConfigError
from areal_agents.models.loading import load_tokenizer
from areal_agents.progress import plural, progress_bar
from areal_agents.rollout.controller import Group, RolloutController
from areal_agents.rollout.episodes import RolloutLedger
from areal_agents.rollout.held_out import evaluate
from areal_agents.trainers.checkpoint import checkpoints, load_trainer_state, prune_checkpoints, save_checkpoint
from areal_agents.trainers.interrupt import Interrupt
from areal_agents.trainers.metrics import MetricsWriter, prefixed
from areal_agents.trainers.policy import SHARED, Policy, open_policy
from areal_agents.trainers.ppo import streamable
from areal_agents.trainers.resume import check_resume_config, forget_after, with_config_rates
from areal_agents.trainers.run_start import held_out_seeds, open_checked_backend, prepare_run_dir, seed_everything
from areal_agents.trainers.step_stats import (
    dump_trajectories,
    gpu_utilisation,
    has_reward_variance,
    ledger_counts,
    reward_breakdown,
)
from areal_agents.trainers.trainer_process import ProcessPolicy, open_process_policy
from areal_agents.types import SamplingParams, Trajectory


def run_train(
    cfg: TrainConfig, progress: bool = True, resume: bool = False, allow_config_change: bool = False
) -> dict[str, Any]:
    """Run RL as configured (``resume``: from the run's newest checkpoint, with the run's saved config
    less `FREE_KEYS` unless ``allow_config_change``); return the summary also written to
    ``run_dir/summary.json``. SIGINT or SIGTERM save the last finished step first (`Interrupt`)."""
    state, found, changes = None, None, []
    if resume:
        found = checkpoints(cfg.run_dir)
        if not found:
            raise ConfigError(f"--resume: no complete checkpoint under {Path(cfg.run_dir) / 'checkpoints'}")
        changes = check_resume_config(cfg.run_dir, cfg, allow_config_change)
    starts = dict(cfg.policies) if cfg.policies else {SHARED: cfg.model.path}  # policy name -> starting model
    tokenizer = load_tokenizer(cfg.model.path)
    run_dir = prepare_run_dir(cfg.run_dir, cfg)
    seed_everything(cfg.seed)
    if found:
        state = load_trainer_state(found[-1])  # also puts the global RNGs back
        print(f"resuming from {found[-1]} (step {state['step']}, policy version {state['version']})")
        if changes:
            print(f"with config changes (--allow-config-change): {'; '.join(changes)}")
    forget_after(run_dir, state["step"] if state else 0)  # steps after the checkpoint are redone, and logged anew
    policies: dict[str, Policy] = {}
    cluster = None
    # This thread runs the event loop (agents, envs), not tensors: one intra-op thread, so the torch
    # work it does start (weight swaps) adds no OpenMP team beside the trainer's and the engine's.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with Interrupt() as interrupt:  # SIGTERM before the loop runs: SystemExit(143), servers stopped
        try:
            if cfg.launcher == "ray":  # the same run, its parts as Ray actors (areal_agents/cluster)
                if importlib.util.find_spec("ray") is None:
                    raise ConfigError("launcher=ray needs Ray, which is not installed: pip install 'areal-agents[ray]'")
                from areal_agents.cluster.ray_launcher import RayLauncher  # noqa: PLC0415

                cluster = RayLauncher(cfg)
            for name, start in starts.items():
                path = str(found[-1] / _model_dir(name)) if found else start
                if cluster is not None:
                    policies[name] = cluster.open_policy(name, path, start, run_dir)
                elif cfg.ppo.trainer == "process":
                    policies[name] = open_process_policy(name, cfg, path, start, run_dir)
                else:
                    policies[name] = open_policy(name, cfg, path, start, run_dir)
                if state is not None:
                    policies[name].engine.set_version(state["version"])
            return interrupt.run(_train(cfg, tokenizer, policies, run_dir, progress, state, interrupt, cluster))
        finally:
            for policy in policies.values():
                if policy.servers is not None:
                    policy.servers.stop()
                if isinstance(policy, (Policy, ProcessPolicy)):  # a Ray trainer group is closed by cluster.shutdown()
                    policy.close()
            if cluster is not None:
                cluster.shutdown()
            torch.set_num_threads(threads)


def _model_dir(name: str) -> str:
    """Where a policy's model lives inside a checkpoint."""
    return "model" if name == SHARED else f"policies/{name}/model"


async def _train(cfg, tokenizer, policies, run_dir, progress, state, interrupt, cluster=None):
    # a bad env id or kwargs fail here
    backend = await open_checked_backend(cfg.env, cfg.eval, cluster.env_backend() if cluster else None)
    r = cfg.rollout
    if state is not None:
        for policy in policies.values():
            if isinstance(policy.engine, SGLangEngine):
                await policy.engine.announce_version()  # fresh servers say "default", not the run's version
    shared = SHARED in policies
    engine = policies[SHARED].engine if shared else {name: p.engine for name, p in policies.items()}
    agents = []  # the sampling agent, and the same agent logic decoding greedily for evaluation
    try:
        for sampling in (
            None,
            SamplingParams(r.max_new_tokens, temperature=cfg.eval.temperature, top_p=cfg.eval.top_p),
        ):
            agents.append(make_rollout_agent(r, engine, tokenizer, sampling))
        return await _train_loop(
            cfg, tokenizer, policies, backend, agents, run_dir, progress, state, interrupt, cluster
        )
    except asyncio.CancelledError:
        if not interrupt.caught():
            raise
        await interrupt.stop()  # the loop's handler: save the last finished step; raises Interrupted
    finally:
        for agent in agents:
            if hasattr(agent, "aclose"):
                await agent.aclose()
        await backend.aclose()
        for policy in policies.values():
            await policy.engine.aclose()


async def _train_loop(cfg, tokenizer, policies, backend, agents, run_dir, progress, state, interrupt, cluster):
    r = cfg.rollout
    agent, greedy = agents
    main = next(iter(policies.values()))  # its engine's version is the run's (all advance together)
    eval_seeds = await held_out_seeds(backend, cfg.eval)
    ledger = RolloutLedger()
    generator = torch.Generator().manual_seed(cfg.seed)
    first_step, data_position = 1, 0
    if state is not None:
        ppo = cfg.ppo
        for name, policy in policies.items():  # the rates of the config (an allowed change takes effect)
            train_state = state if name == SHARED else state["policies"][name]
            policy.load_train_state(with_config_rates(train_state, ppo.lr, ppo.weight_decay, ppo.critic_lr))
        generator.set_state(state["generator"])
        ledger = RolloutLedger(**{k: v for k, v in state["ledger"].items() if k != "running"})
        ledger.submitted -= state["ledger"]["running"]  # episodes cut off by the stop run again
        first_step, data_position = state["step"] + 1, state["data_position"]
    # TensorBoard hides what an earlier run logged from here on (a resumed run redoes those steps)
    metrics = MetricsWriter(run_dir / "tensorboard", purge_step=first_step if state is not None else 0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def make_eval_env() -> AsyncEnv:
        return backend.make(**cfg.eval.env_kwargs)

    async def run_eval(step: int) -> dict[str, float]:
        result = await evaluate(greedy, make_eval_env, eval_seeds, r.max_concurrent_rollouts, cfg.eval.n_samples)
        metrics.log(step, prefixed("eval", result))
        return result

    def seed_at(index: int) -> int:
        """Prompt ``index`` of the run: a pure function of (seed, index), so a resumed run sees the same data."""
        return int(np.random.default_rng([cfg.seed, index]).integers(0, 2**31 - 1))

    controller = RolloutController(
        agent,
        backend.make,
        seed_at,
        batch_size=r.batch_size,
        group_size=r.group_size,
        get_version=main.engine.get_version,
        max_staleness=r.max_staleness,
        max_concurrent_episodes=r.max_concurrent_rollouts,
        group_filter=has_reward_variance if r.dynamic_sampling else None,
        max_retries=r.max_retries,
        ledger=ledger,
        start_index=data_position,
        groups_before=(first_step - 1) * r.batch_size,
        run_episode=cluster.episode_runner(main.engine).run_episode if cluster else None,  # else in this process
    )
    start = time.perf_counter()
    before = await run_eval(0) if state is None else {"accuracy": state["accuracy_before"]}
    print(f"held-out greedy accuracy before RL: {before['accuracy']:.1%} ({plural(len(eval_seeds), 'problem')})")
    totals = {"trained_samples": 0, "consumed_samples": 0, "generated_tokens": 0, "rollout_seconds": 0.0}
    totals |= {"train_seconds": 0.0, "step_seconds": 0.0, "engine_busy_seconds": 0.0}
    last_save = time.monotonic()

    def snapshot() -> dict[str, Any]:
        """What a checkpoint of the step just finished holds besides the policies' weights and train state."""
        extra = {"data_position": controller.data_position, "generator": generator.get_state()}
        return extra | {"accuracy_before": before["accuracy"]} | _state(main.engine, ledger)

    saved, snap = first_step - 1, {}  # the newest checkpoint's step; `snapshot` at the last step's end

    def checkpoint(step: int, extra: dict[str, Any]) -> Path:
        nonlocal saved
        if SHARED in policies:
            extra = extra | policies[SHARED].train_state()
        else:
            extra = extra | {"policies": {name: p.train_state() for name, p in policies.items()}}
        models = {_model_dir(name): p.model for name, p in policies.items()}
        path = save_checkpoint(run_dir, step, models, tokenizer, extra)
        prune_checkpoints(run_dir, cfg.keep_checkpoints)
        saved = step
        return path

    async def save_on_interrupt() -> None:
        """A signal abandoned the step in progress (untrained): checkpoint the last finished one."""
        await controller.aclose()
        metrics.close()
        if done <= saved:
            print(f"stopped by {interrupt.name}: no step finished since the checkpoint of step {saved}, none written")
            return
        for policy in policies.values():  # an abandoned streamed update's backward may still be running
            if isinstance(policy, Policy) and policy.trainer is not None:
                await asyncio.get_running_loop().run_in_executor(policy.trainer, int)
        path = checkpoint(done, snap)
        print(f"stopped by {interrupt.name} after step {done}: checkpoint {path} (--resume continues from it)")

    interrupt.on_stop = save_on_interrupt

    seen: dict[str, float] = {"time": time.perf_counter()}  # a local hf engine's counters at the last step

    local_engine = isinstance(main.engine, (HFEngine, ProcessEngine))  # whose counters it can read

    async def engine_use() -> dict[str, float]:
        """Of a local hf engine since the last step (evals included): the share of context tokens its
        prefills took from the prefix cache, of the time it was busy, and its rows per decode step."""
        if not local_engine:
            return {}
        stats, now = await main.engine.get_stats(), time.perf_counter()
        keys = ("prefix_hit_tokens", "prefill_tokens", "busy_seconds", "generated_tokens", "decode_steps")
        new = {k: float(getattr(stats, k)) for k in keys} | {"time": now}
        d = {k: v - seen.get(k, 0.0) for k, v in new.items()}
        seen.update(new)
        totals["engine_busy_seconds"] += d["busy_seconds"]
        return {
            "engine/prefix_hit_rate": d["prefix_hit_tokens"] / max(d["prefix_hit_tokens"] + d["prefill_tokens"], 1),
            "engine/busy_fraction": d["busy_seconds"] / max(d["time"], 1e-9),
            "engine/rows_per_decode_step": d["generated_tokens"] / max(d["decode_steps"], 1),
        }

    await engine_use()  # the counters from here on: the training steps' (and their evals')
    totals["engine_busy_seconds"] = 0.0
    # a local trainer can start on a batch's finished groups while its last generate (the same gradient)
    stream = (
        cfg.ppo.stream_updates
        and r.max_staleness > 0
        and streamable(cfg.ppo)
        and all(isinstance(p, (Policy, ProcessPolicy)) for p in policies.values())
    )
    # counts steps of the whole run (a resumed one starts at its checkpoint); updated at each step's end,
    # so the last step (which leaves the loop by `break`) is counted too
    done = min(first_step - 1, cfg.steps)  # the last step trained
    bar = progress_bar(total=cfg.steps, initial=done, desc="rl", enabled=progress)
    for step in range(first_step, cfg.steps + 1):
        t0 = time.perf_counter()
        # episodes keep running while we train (max_staleness > 0); t1: the batch's last group in hand;
        # waited: seconds the trainer sat idle for rollouts
        if stream:
            groups, per_policy, t1, waited = await _streamed_update(
                controller, policies, cfg, pad, generator, interrupt
            )
        else:
            groups = await controller.get_batch()
            interrupt.hold()  # the update starts: a signal now waits for the step's end
            t1 = time.perf_counter()
            waited = t1 - t0
            per_policy = {}
            for name, batch in _route(_trajectories(groups), policies).items():  # each on its own agents' data
                per_policy[name] = await policies[name].update(batch, cfg, pad, generator)
        trajectories = _trajectories(groups)
        with open(run_dir / "data_order.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "prompts": [g.index for g in groups]}) + "\n")
        if r.dump_trajectories:
            dump_trajectories(run_dir / "trajectories" / f"step_{step}.jsonl", trajectories)
        stats: dict[str, float] = {}
        for name, policy_stats in per_policy.items():
            stats |= policy_stats if name == SHARED else prefixed(name, policy_stats)
        stats["trained_trajectories"] = sum(s.get("trained_trajectories", 0.0) for s in per_policy.values())
        spent = totals["step_seconds"] + time.perf_counter() - t0
        last = step == cfg.steps or bool(cfg.max_train_minutes and spent >= 60 * cfg.max_train_minutes)
        if last:
            controller.pause()  # the last update needs no more rollouts
        for policy in policies.values():
            await policy.push_weights()
        controller.notify_version()
        t2 = time.perf_counter()

        generated = sum(t.num_generated for t in trajectories)
        rewards = [t.reward for t in trajectories]
        staleness = controller.stats.staleness[-len(trajectories) :] or [0]
        rollout_stats = {
            "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
            "accuracy": float(np.mean([x >= 1.0 for x in rewards])) if rewards else 0.0,
            "generated_tokens": float(generated),
            "episodes_failed": float(ledger.failed),
            "episodes_env_failed": float(ledger.env_failed),
            "episodes_engine_failed": float(ledger.engine_failed),
            "episodes_worker_failed": float(ledger.worker_failed),
            "episode_retries": float(controller.stats.retries),
            "episodes_rejected": float(ledger.rejected),
            "episodes_running": float(ledger.running),
            "queued_groups": float(controller.queued_groups),
            "running_groups": float(controller.running_groups),
            "staleness_mean": float(np.mean(staleness)),
            "staleness_max": float(max(staleness)),
            **reward_breakdown(trajectories, cfg.env.id),
        }
        perf = {
            "gen_tokens_per_s": generated / max(t1 - t0, 1e-9),
            "trained_samples_per_s": stats.get("trained_trajectories", 0.0) / max(t2 - t0 - waited, 1e-9),
            "train_tokens_per_s": sum(len(t) for t in trajectories) / max(t2 - t0 - waited, 1e-9),
            "rollout_wait_seconds": waited,
            "step_seconds": t2 - t0,
            **gpu_utilisation(),
        }
        totals["trained_samples"] += int(stats.get("trained_trajectories", 0))
        totals["generated_tokens"] += generated
        totals["rollout_seconds"] += t1 - t0
        totals["train_seconds"] += t2 - t0 - waited
        totals["step_seconds"] += t2 - t0
        totals["consumed_samples"] += len(trajectories)
        metrics.log(
            step,
            {
                **prefixed("rollout", rollout_stats),
                **prefixed("train", stats),
                **prefixed("perf", perf),
                "engine/version": float(main.engine.get_version()),
                **(await engine_use()),
            },
        )
        metrics.histogram(step, "rollout/staleness", staleness)
        bar.set_postfix(
            reward=f"{rollout_stats['reward_mean']:.3f}",
            acc=f"{rollout_stats['accuracy']:.2f}",
            tok_s=f"{perf['gen_tokens_per_s']:.0f}",
            refresh=False,
        )
        bar.update()
        done, snap = step, snapshot()
        interrupt.release()  # a signal that came while the step trained stops the run here
        if cfg.eval.every and step % cfg.eval.every == 0 and not last:
            result = await run_eval(step)
            bar.write(f"step {step}: held-out greedy accuracy {result['accuracy']:.1%}")
        every_steps = cfg.save_every and step % cfg.save_every == 0
        every_minutes = cfg.save_every_minutes and time.monotonic() - last_save >= 60 * cfg.save_every_minutes
        if (every_steps or every_minutes) and not last:
            checkpoint(step, snap)
            last_save = time.monotonic()
        if last:
            break
    bar.close()
    await controller.aclose()  # episodes still in flight (max_staleness > 0) end as cancelled

    if done < cfg.steps:
        print(f"stopped after step {done}: max_train_minutes={cfg.max_train_minutes:g} of training steps spent")
    after = await run_eval(done)
    ckpt = checkpoint(done, snapshot())
    metrics.close()
    wall = time.perf_counter() - start
    summary = {
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "eval_problems": len(eval_seeds),
        "steps": done,
        "engine_version": main.engine.get_version(),
        "wall_seconds": wall,
        "trained_samples_per_s": totals["trained_samples"] / max(totals["train_seconds"], 1e-9),
        # end to end over the training steps (rollout waits + training + weight pushes), evals excluded
        "samples_per_s": totals["consumed_samples"] / max(totals["step_seconds"], 1e-9),
        "generated_tokens_per_s": totals["generated_tokens"] / max(totals["rollout_seconds"], 1e-9),
        # where the training steps' time went: the trainer busy (the rest it waited for rollouts), and the
        # share of it a local hf engine was busy decoding (None for other engines)
        "step_seconds": totals["step_seconds"],
        "train_seconds": totals["train_seconds"],
        "engine_busy_fraction": (
            totals["engine_busy_seconds"] / max(totals["step_seconds"], 1e-9) if local_engine else None
        ),
        "episodes": ledger_counts(ledger),
        "episode_retries": controller.stats.retries,  # env, engine or worker failures run again
        "checkpoint": str(ckpt),
    }
    if cluster is not None:
        summary["cluster"] = cluster.stats()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"held-out greedy accuracy after RL:  {after['accuracy']:.1%}  "
        f"(before {before['accuracy']:.1%}, {plural(summary['eval_problems'], 'problem')})\n"
        f"{plural(done, 'step')} in {wall:.0f}s | {summary['trained_samples_per_s']:.0f} trained samples/s | "
        f"{summary['generated_tokens_per_s']:.0f} generated tokens/s | "
        f"engine version {summary['engine_version']}\n"
        f"checkpoint: {ckpt}\ntensorboard: {run_dir / 'tensorboard'}"
    )
    return summary


def _state(engine: InferenceEngine, ledger: RolloutLedger) -> dict[str, Any]:
    return {
        "version": engine.get_version(),
        "ledger": ledger_counts(ledger),
    }


async def _streamed_update(
    controller: RolloutController,
    policies: dict[str, Policy],
    cfg: TrainConfig,
    pad: int,
    generator: torch.Generator,
    interrupt: Interrupt,
) -> tuple[list[Group], dict[str, dict[str, float]], float, float]:
    """Take a batch and train on it, feeding each policy's update the groups taken so far whenever it is
    free (``ppo.stream_updates``): its forward/backward runs while the batch's last groups generate.
    The batch (prompt order), each policy's stats, when its last group was taken, and the seconds the
    trainer waited for groups."""
    taken: asyncio.Queue[Group | None] = asyncio.Queue()
    last, waited = [0.0], 0.0

    async def take() -> None:
        try:
            async for group in controller.stream_batch():
                taken.put_nowait(group)
            last[0] = time.perf_counter()
        finally:
            taken.put_nowait(None)  # the end, or the controller's error (re-raised by ``await feeder``)

    feeder = asyncio.ensure_future(take())
    groups: list[Group] = []
    try:
        end = False
        while not end:
            idle = time.perf_counter()
            part = [await taken.get()]  # at once if groups are waiting
            waited += time.perf_counter() - idle
            while not taken.empty():
                part.append(taken.get_nowait())
            end = part[-1] is None
            part = [g for g in part if g is not None]
            groups += part
            routed = _route(_trajectories(part), policies).items() if part else ()
            await asyncio.gather(*(policies[name].update_part(b, cfg, pad) for name, b in routed if b))
        await feeder
    finally:
        feeder.cancel()
    interrupt.hold()  # the optimizer steps: a signal now waits for the step's end
    stats = {name: await policy.finish_update(cfg, pad, generator) for name, policy in policies.items()}
    return sorted(groups, key=lambda g: g.index), stats, last[0], waited


def _trajectories(groups: list[Group]) -> list[Trajectory]:
    return [t for g in groups for t in g.trajectories]


def _route(trajectories: list[Trajectory], policies: dict[str, Policy]) -> dict[str, list[Trajectory]]:
    """Trajectories by the policy that trains on them: all to the shared one, or by agent id."""
    if SHARED in policies:
        return {SHARED: trajectories}
    out: dict[str, list[Trajectory]] = {name: [] for name in policies}
    for t in trajectories:
        if t.agent_id not in out:
            raise ConfigError(
                f"policies: agent {t.agent_id!r} produced data but has no policy; policies: {sorted(out)}"
            )
        out[t.agent_id].append(t)
    return out
