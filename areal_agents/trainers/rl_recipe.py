"""`areal-agents train`: RL with decoupled PPO, read top to bottom.

Each step: roll out ``batch_size`` prompts x ``group_size`` episodes with the engine -> one PPO update
on the trainer's copy of the policy -> push the new weights to the engine (version + 1). Held-out
greedy accuracy is measured before and after (and every ``eval.every`` steps).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from areal_agents.agents.factory import make_agent
from areal_agents.config import TrainConfig
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.launcher import open_engine
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.errors import ConfigError
from areal_agents.models.loading import load_model, load_tokenizer
from areal_agents.rollout.controller import Group, RolloutController
from areal_agents.rollout.episodes import RolloutLedger
from areal_agents.rollout.evaluate import evaluate
from areal_agents.trainers.checkpoint import checkpoints, load_trainer_state, prune_checkpoints, save_checkpoint
from areal_agents.trainers.critic import ValueModel
from areal_agents.trainers.metrics import MetricsWriter, prefixed
from areal_agents.trainers.ppo import ppo_update
from areal_agents.trainers.setup import (
    held_out_seeds,
    make_optimizer,
    open_checked_backend,
    prepare_run_dir,
    seed_everything,
)
from areal_agents.types import SamplingParams, Trajectory


def run_train(cfg: TrainConfig, progress: bool = True, resume: bool = False) -> dict[str, Any]:
    """Run RL as configured (``resume``: from the run's newest checkpoint); return the summary also
    written to ``run_dir/summary.json``."""
    state, model_path = None, cfg.model.path
    if resume:
        found = checkpoints(cfg.run_dir)
        if not found:
            raise ConfigError(f"--resume: no complete checkpoint under {Path(cfg.run_dir) / 'checkpoints'}")
        model_path = str(found[-1] / "model")
    tokenizer = load_tokenizer(model_path)
    policy = load_model(model_path, cfg.model.dtype)  # the trainer's copy
    run_dir = prepare_run_dir(cfg.run_dir, cfg)
    seed_everything(cfg.seed)
    if resume:
        state = load_trainer_state(found[-1])  # also puts the global RNGs back
        print(f"resuming from {found[-1]} (step {state['step']}, policy version {state['version']})")
    # The rollout copy: in-process, or model servers (serve-model / SGLang) behind an HTTP client.
    engine, servers = open_engine(cfg.engine, model_path, cfg.model.dtype, run_dir=run_dir, seed=cfg.seed)
    if state is not None:
        engine.set_version(state["version"])
    try:
        return asyncio.run(_train(cfg, tokenizer, policy, engine, run_dir, progress, state))
    finally:
        if servers is not None:
            servers.stop()


async def _train(cfg, tokenizer, policy, engine, run_dir, progress, state):
    backend = await open_checked_backend(cfg.env, cfg.eval)  # a bad env id or kwargs fail here
    r = cfg.rollout
    agents = []  # the sampling agent, and the same agent logic decoding greedily for evaluation
    try:
        for sampling in (
            SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k),
            SamplingParams(r.max_new_tokens, temperature=0.0),
        ):
            kwargs = {"system_prompt": r.system_prompt, "kwargs": r.agent_kwargs}
            agents.append(make_agent(r.agent, engine, tokenizer, sampling, **kwargs))
        return await _train_loop(cfg, tokenizer, policy, engine, backend, agents, run_dir, progress, state)
    finally:
        for agent in agents:
            if hasattr(agent, "aclose"):
                await agent.aclose()
        await backend.aclose()
        await engine.aclose()


async def _train_loop(cfg, tokenizer, policy, engine, backend, agents, run_dir, progress, state):
    r = cfg.rollout
    agent, greedy = agents
    eval_seeds = await held_out_seeds(backend, cfg.eval)
    p = cfg.ppo
    optimizer_steps = cfg.steps * p.ppo_epochs * p.num_minibatches
    optimizer, scheduler = make_optimizer(policy, p.lr, p.weight_decay, p.warmup_steps, p.lr_schedule, optimizer_steps)
    if p.activation_checkpointing:
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    reference = None  # the initial policy, frozen, for the KL penalty
    if p.kl_coef > 0:
        reference = load_model(cfg.model.path, cfg.model.dtype).eval().requires_grad_(False)
    critic = critic_optimizer = None  # GAE: a value model initialised from the starting checkpoint
    if p.advantage == "gae":
        critic_lm = load_model(cfg.model.path, cfg.model.dtype)
        if p.activation_checkpointing:
            critic_lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        critic = ValueModel(critic_lm)
        critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=p.critic_lr, weight_decay=p.weight_decay)
    metrics = MetricsWriter(run_dir / "tensorboard")
    ledger = RolloutLedger()
    generator = torch.Generator().manual_seed(cfg.seed)
    first_step, data_position = 1, 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        generator.set_state(state["generator"])
        if critic is not None:
            if "critic" not in state:
                raise ConfigError("--resume: ppo.advantage=gae but the checkpoint holds no critic")
            critic.load_state_dict(state["critic"])
            critic_optimizer.load_state_dict(state["critic_optimizer"])
        ledger = RolloutLedger(**{k: v for k, v in state["ledger"].items() if k != "running"})
        ledger.submitted -= state["ledger"]["running"]  # episodes cut off by the stop run again
        first_step, data_position = state["step"] + 1, state["data_position"]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def make_eval_env() -> AsyncEnv:
        return backend.make(**cfg.eval.env_kwargs)

    async def run_eval(step: int) -> dict[str, float]:
        result = await evaluate(greedy, make_eval_env, eval_seeds, r.max_concurrent_rollouts)
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
        get_version=engine.get_version,
        max_staleness=r.max_staleness,
        max_concurrent_groups=max(1, r.max_concurrent_rollouts // r.group_size),
        group_filter=_has_reward_variance if r.dynamic_sampling else None,
        max_retries=r.max_retries,
        ledger=ledger,
        start_index=data_position,
        groups_before=(first_step - 1) * r.batch_size,
    )
    start = time.perf_counter()
    before = await run_eval(0) if state is None else {"accuracy": state["accuracy_before"]}
    print(f"held-out greedy accuracy before RL: {before['accuracy']:.1%} ({len(eval_seeds)} problems)")
    totals = {"trained_samples": 0, "consumed_samples": 0, "generated_tokens": 0, "rollout_seconds": 0.0}
    totals |= {"train_seconds": 0.0, "step_seconds": 0.0}
    last_save = time.monotonic()

    def checkpoint(step: int) -> Path:
        extra = {"data_position": controller.data_position, "generator": generator.get_state()}
        extra["accuracy_before"] = before["accuracy"]
        if critic is not None:
            extra |= {"critic": critic.state_dict(), "critic_optimizer": critic_optimizer.state_dict()}
        path = save_checkpoint(run_dir, step, policy, tokenizer, optimizer, scheduler, _state(engine, ledger) | extra)
        prune_checkpoints(run_dir, cfg.keep_checkpoints)
        return path

    bar = tqdm(range(first_step, cfg.steps + 1), desc="rl", disable=not progress, dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        groups = await controller.get_batch()  # episodes keep running while we train (max_staleness > 0)
        trajectories = [t for g in groups for t in g.trajectories]
        with open(run_dir / "data_order.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "prompts": [g.index for g in groups]}) + "\n")
        t1 = time.perf_counter()
        stats = await asyncio.to_thread(
            ppo_update,
            policy,
            optimizer,
            scheduler,
            trajectories,
            cfg.ppo,
            temperature=r.temperature,
            pad_token_id=pad,
            generator=generator,
            ref_model=reference,
            critic=critic,
            critic_optimizer=critic_optimizer,
        )
        if step == cfg.steps:
            controller.pause()  # the last update needs no more rollouts
        await engine.update_weights(policy.state_dict())  # pause, swap, version + 1, resume
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
            "episodes_rejected": float(ledger.rejected),
            "episodes_running": float(ledger.running),
            "queued_groups": float(controller.queued_groups),
            "running_groups": float(controller.running_groups),
            "staleness_mean": float(np.mean(staleness)),
            "staleness_max": float(max(staleness)),
            **_reward_breakdown(trajectories, cfg.env.id),
        }
        perf = {
            "gen_tokens_per_s": generated / max(t1 - t0, 1e-9),
            "trained_samples_per_s": stats.get("trained_trajectories", 0.0) / max(t2 - t1, 1e-9),
            "train_tokens_per_s": sum(len(t) for t in trajectories) / max(t2 - t1, 1e-9),
            "step_seconds": t2 - t0,
            **_gpu_utilisation(),
        }
        totals["trained_samples"] += int(stats.get("trained_trajectories", 0))
        totals["generated_tokens"] += generated
        totals["rollout_seconds"] += t1 - t0
        totals["train_seconds"] += t2 - t1
        totals["step_seconds"] += t2 - t0
        totals["consumed_samples"] += len(trajectories)
        metrics.log(
            step,
            {
                **prefixed("rollout", rollout_stats),
                **prefixed("train", stats),
                **prefixed("perf", perf),
                "engine/version": float(engine.get_version()),
            },
        )
        metrics.histogram(step, "rollout/staleness", staleness)
        bar.set_postfix(
            reward=f"{rollout_stats['reward_mean']:.3f}",
            acc=f"{rollout_stats['accuracy']:.2f}",
            tok_s=f"{perf['gen_tokens_per_s']:.0f}",
            refresh=False,
        )
        if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.steps:
            result = await run_eval(step)
            bar.write(f"step {step}: held-out greedy accuracy {result['accuracy']:.1%}")
        every_steps = cfg.save_every and step % cfg.save_every == 0
        every_minutes = cfg.save_every_minutes and time.monotonic() - last_save >= 60 * cfg.save_every_minutes
        if (every_steps or every_minutes) and step < cfg.steps:
            checkpoint(step)
            last_save = time.monotonic()
    bar.close()
    await controller.aclose()  # episodes still in flight (max_staleness > 0) end as cancelled

    after = await run_eval(cfg.steps)
    ckpt = checkpoint(cfg.steps)
    metrics.close()
    wall = time.perf_counter() - start
    summary = {
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "eval_problems": len(eval_seeds),
        "steps": cfg.steps,
        "engine_version": engine.get_version(),
        "wall_seconds": wall,
        "trained_samples_per_s": totals["trained_samples"] / max(totals["train_seconds"], 1e-9),
        # end to end over the training steps (rollout waits + training + weight pushes), evals excluded
        "samples_per_s": totals["consumed_samples"] / max(totals["step_seconds"], 1e-9),
        "generated_tokens_per_s": totals["generated_tokens"] / max(totals["rollout_seconds"], 1e-9),
        "episodes": _ledger(ledger),
        "checkpoint": str(ckpt),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"held-out greedy accuracy after RL:  {after['accuracy']:.1%}  "
        f"(before {before['accuracy']:.1%}, {summary['eval_problems']} problems)\n"
        f"{cfg.steps} steps in {wall:.0f}s | {summary['trained_samples_per_s']:.0f} trained samples/s | "
        f"{summary['generated_tokens_per_s']:.0f} generated tokens/s | "
        f"engine version {summary['engine_version']}\n"
        f"checkpoint: {ckpt}\ntensorboard: {run_dir / 'tensorboard'}"
    )
    return summary


def _state(engine: InferenceEngine, ledger: RolloutLedger) -> dict[str, Any]:
    return {
        "version": engine.get_version(),
        "ledger": _ledger(ledger),
    }


def _ledger(ledger: RolloutLedger) -> dict[str, int]:
    return {**dataclasses.asdict(ledger), "running": ledger.running}


def _reward_breakdown(trajectories: list[Trajectory], default_env: str) -> dict[str, float]:
    """Mean reward per env (``metadata["env"]``, else the run's env id) and mean reward of each turn."""
    by_env: dict[str, list[float]] = defaultdict(list)
    by_turn: dict[int, list[float]] = defaultdict(list)
    for t in trajectories:
        if t.metadata.get("segment", 0) != 0:
            continue  # later segments of an episode repeat its rewards
        by_env[str(t.metadata.get("env", default_env))].append(t.reward)
        for k, r in enumerate(t.turn_rewards):
            by_turn[k + 1].append(r)
    out = {f"reward_env/{env}": float(np.mean(v)) for env, v in by_env.items()}
    return out | {f"reward_turn/{k}": float(np.mean(v)) for k, v in sorted(by_turn.items())}


def _gpu_utilisation() -> dict[str, float]:
    """Utilisation (%) of each visible GPU, when there is one and NVML can read it."""
    if not torch.cuda.is_available():
        return {}
    try:
        return {f"gpu{i}_utilisation": float(torch.cuda.utilization(i)) for i in range(torch.cuda.device_count())}
    except Exception:  # noqa: BLE001  (no pynvml / NVML: skip rather than fail a run over a metric)
        return {}


def _has_reward_variance(group: Group) -> bool:
    """Dynamic sampling's filter: a group whose rewards are all equal teaches GRPO nothing."""
    return len({t.reward for t in group.trajectories}) > 1
