"""TRL's GRPOTrainer vs our trainer: same SFT checkpoint, task, group size, batch and generation length, same run.

    .venv/bin/pip install -e '.[bench]'          # trl: a bench-only dependency
    .venv/bin/python bench/vs_trl.py [--minutes 4] [--sft-model runs/bench_vs_trl/sft/model] [--out runs/bench_vs_trl]
    .venv/bin/python bench/vs_trl.py --lr 1e-4 --set rollout.group_size=8 --set rollout.batch_size=8

Both trainers start from one SFT checkpoint of the arithmetic recipe (built here as bench/e2e_arith.py builds
it, or reused with ``--sft-model``) and get the same wall budget of training steps (rollout + update; start-up
and evaluation excluded), each in a fresh process of its own. Every setting of examples/arithmetic/rl.yaml
(plus ``--set`` overrides) is mapped onto GRPOConfig: prompts per step, group size, max new tokens,
temperature / top-p / top-k, learning rate and schedule, clip range, grad-norm clip, KL coefficient,
advantage scaling, epochs and minibatches. TRL's prompts
are the env's reset observations of the same prompt seeds in the same order, rendered with the same system
prompt and chat template (checked token for token), and its reward calls the same env's ``step``. Held-out
greedy accuracy of the SFT start and of both final models is measured afterwards by our evaluator
(areal_agents.rollout.held_out over an HFEngine), on the same problems.

Not matched: our recipe drops groups whose rewards are all equal before the update
(``ppo.filter_zero_variance_groups``), so it trains on fewer samples and its token-mean loss averages over
fewer tokens; GRPOTrainer has no such filter (``--set ppo.filter_zero_variance_groups=false`` turns ours
off). rl.yaml's lr 3e-4 is where TRL 1.16 collapsed in a reference run; ``--trl-lr 1e-4`` gives TRL its best.

Prints seconds per step, samples/s (completions per second of step time) and held-out accuracy; writes
``OUT/vs_trl.json``. Target (issue): >= 2x TRL's samples/s and a higher held-out accuracy after the same budget.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import multiprocessing
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from e2e_arith import prepare_sft  # bench/ is on sys.path when this script runs

from areal_agents.agents.chat_agent import ChatAgent
from areal_agents.agents.chat_tokens import ChatTokens
from areal_agents.config import TrainConfig, load_config
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.envs.registry import import_env_module, make_env
from areal_agents.models import load_model, load_tokenizer
from areal_agents.rollout.held_out import evaluate
from areal_agents.trainers.checkpoint import save_model
from areal_agents.trainers.rl_recipe import run_train
from areal_agents.trainers.run_start import held_out_seeds, open_checked_backend
from areal_agents.trainers.sft_recipe import run_sft
from areal_agents.types import SamplingParams

try:
    import datasets
    import trl
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise SystemExit(f"bench/vs_trl.py needs the bench extra ({e}): .venv/bin/pip install -e '.[bench]'") from None

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "arithmetic"
# transformers 5.2x renamed gradient_checkpointing (GRPOConfig's default: True) and warns on the old name
CHECKPOINTING = next(
    (f.name for f in dataclasses.fields(GRPOConfig) if f.name == "activation_checkpointing"), "gradient_checkpointing"
)
FASTEST_STEP_S = 0.1  # sizes TRL's prompt list: no budget runs out of prompts unless a step is faster than this


# ---- the SFT start, as bench/e2e_arith.py makes it -------------------------------------------------------------


def build_sft(out: Path, seed: int, steps: int | None) -> Path:
    return Path(run_sft(prepare_sft(out, seed, steps), progress=False)["model"])


# ---- TRL: the same prompts, reward and settings ----------------------------------------------------------------


def prompt_seed(seed: int, index: int) -> int:
    """The env seed of prompt ``index`` of a run, exactly as `rl_recipe`'s ``seed_at`` draws it."""
    return int(np.random.default_rng([seed, index]).integers(0, 2**31 - 1))


def messages_for(cfg: TrainConfig, observation: str, info: dict) -> list[dict[str, str]]:
    """The first prompt as `ChatAgent` builds it: optional system message, then the observation."""
    system = [{"role": "system", "content": cfg.rollout.system_prompt}] if cfg.rollout.system_prompt else []
    return [*system, {"role": info.get("role", "user"), "content": observation}]


def trl_dataset(cfg: TrainConfig, num_prompts: int) -> datasets.Dataset:
    """Conversational prompts from env resets of our run's prompt seeds, in our run's order."""
    import_env_module(cfg.env.module)
    env = make_env(cfg.env.id, **cfg.env.kwargs)
    prompts, seeds = [], []
    for index in range(num_prompts):
        seed = prompt_seed(cfg.seed, index)
        observation, info = env.reset(seed=seed)
        prompts.append(messages_for(cfg, observation, info))
        seeds.append(seed)
    return datasets.Dataset.from_dict({"prompt": prompts, "env_seed": seeds})


def check_same_tokens(tokenizer: Any, dataset: datasets.Dataset, rows: int = 32) -> None:
    """TRL tokenizes prompts with ``apply_chat_template(tokenize=True)``; our agent with `ChatTokens`."""
    for row in dataset.select(range(min(rows, len(dataset)))):
        ours = ChatTokens(tokenizer)
        ours.start(row["prompt"])
        theirs = tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        if list(theirs) != ours.input_ids:
            raise SystemExit(f"prompt tokens differ for {row['prompt']}: TRL {list(theirs)} vs ours {ours.input_ids}")


def make_reward(cfg: TrainConfig):
    """A TRL reward function that scores each completion with the env's own ``step`` (a one-turn episode)."""
    import_env_module(cfg.env.module)
    env = make_env(cfg.env.id, **cfg.env.kwargs)

    def env_reward(completions: list, env_seed: list[int], **_: Any) -> list[float]:
        rewards = []
        for completion, seed in zip(completions, env_seed):
            text = completion[0]["content"] if isinstance(completion, list) else completion
            env.reset(seed=seed)
            rewards.append(float(env.step(text)[1]))
        return rewards

    return env_reward


class WallBudget(TrainerCallback):
    """Stops training at the first rollout-step boundary after ``budget_s`` seconds of training steps."""

    def __init__(self, budget_s: float, optimizer_steps_per_rollout: int) -> None:
        self.budget_s = budget_s
        self.per_rollout = optimizer_steps_per_rollout
        self.start = self.end = 0.0
        self.step_ends: list[float] = []  # seconds since the start, per optimizer step

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003
        self.end = time.perf_counter()
        self.step_ends.append(self.end - self.start)
        if self.end - self.start >= self.budget_s and state.global_step % self.per_rollout == 0:
            control.should_training_stop = True


def grpo_config(cfg: TrainConfig, out: Path, lr: float, max_rollout_steps: int) -> GRPOConfig:
    """Our recipe's settings as GRPOConfig; one rollout step = ``num_minibatches x ppo_epochs`` optimizer steps."""
    r, p = cfg.rollout, cfg.ppo
    samples = r.batch_size * r.group_size
    if samples % p.num_minibatches:
        raise SystemExit(f"batch_size x group_size ({samples}) must divide by ppo.num_minibatches")
    scale = {"grpo": "group", "dr_grpo": "none"}.get(p.advantage)
    if scale is None:
        raise SystemExit(f"ppo.advantage={p.advantage!r} has no GRPOTrainer equivalent; use grpo or dr_grpo")
    return GRPOConfig(
        output_dir=str(out / "trl"),
        seed=cfg.seed,
        use_cpu=True,
        bf16=False,  # GRPOConfig defaults to bf16, ~6x slower on this CPU; ours trains in cfg.model.dtype
        fp16=False,
        **{CHECKPOINTING: False},  # GRPOConfig defaults to True; ours does not checkpoint
        per_device_train_batch_size=samples // p.num_minibatches,  # completions, not prompts
        gradient_accumulation_steps=1,
        steps_per_generation=p.num_minibatches,
        num_iterations=p.ppo_epochs,
        num_generations=r.group_size,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        learning_rate=lr,
        lr_scheduler_type="constant_with_warmup" if p.warmup_steps else "constant",
        warmup_steps=p.warmup_steps,
        weight_decay=p.weight_decay,
        max_grad_norm=p.max_grad_norm,
        beta=p.kl_coef,
        epsilon=p.eps_clip,
        epsilon_high=p.eps_clip_higher if p.eps_clip_higher is not None else p.eps_clip,
        scale_rewards=scale,
        loss_type="dapo",  # token mean over the batch, as our loss
        shuffle_dataset=False,  # our prompt order
        max_steps=max_rollout_steps * p.num_minibatches * p.ppo_epochs,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_steps=10,
        dataloader_num_workers=0,
    )


def run_trl(cfg: TrainConfig, budget_s: float, out: Path, lr: float, steps: int = 0) -> dict[str, Any]:
    """TRL for the wall budget, or for exactly ``steps`` rollout steps when given."""
    r, p = cfg.rollout, cfg.ppo
    max_rollout_steps = steps or max(10, math.ceil(budget_s / FASTEST_STEP_S))
    budget_s = math.inf if steps else budget_s
    tokenizer = load_tokenizer(cfg.model.path)
    dataset = trl_dataset(cfg, max_rollout_steps * r.batch_size)
    check_same_tokens(tokenizer, dataset)
    per_rollout = p.num_minibatches * p.ppo_epochs
    budget = WallBudget(budget_s, per_rollout)
    torch.manual_seed(cfg.seed)
    trainer = GRPOTrainer(
        model=load_model(cfg.model.path, cfg.model.dtype),
        reward_funcs=make_reward(cfg),
        args=grpo_config(cfg, out, lr, max_rollout_steps),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[budget],
    )
    trainer.train()
    steps = trainer.state.global_step // per_rollout
    if steps >= max_rollout_steps and math.isfinite(budget_s):
        print(f"warning: TRL used all {max_rollout_steps} prepared steps before the budget; raise FASTEST_STEP_S")
    seconds = budget.end - budget.start
    model_dir = save_model(out / "trl" / "model", trainer.model, tokenizer)
    return {
        "steps": steps,
        "seconds": seconds,
        "seconds_per_step": seconds / max(steps, 1),
        "samples_per_s": steps * r.batch_size * r.group_size / max(seconds, 1e-9),
        "model": str(model_dir),
        "lr": lr,
        "step_end_seconds": [round(t, 3) for t in budget.step_ends],
    }


# ---- ours: the same budget ------------------------------------------------------------------------------------


def run_areal(cfg: TrainConfig, budget_s: float, out: Path, fixed_steps: int = 0) -> dict[str, Any]:
    """Our recipe for the wall budget (``max_train_minutes``, counted like TRL's: training steps only), or
    for exactly ``fixed_steps``. Its step count is TRL's prepared maximum, so a decaying lr schedule
    would span the same steps in both."""
    samples = cfg.rollout.batch_size * cfg.rollout.group_size
    if fixed_steps:
        cfg = dataclasses.replace(cfg, steps=fixed_steps)
    else:
        steps = max(10, math.ceil(budget_s / FASTEST_STEP_S))
        cfg = dataclasses.replace(cfg, steps=steps, max_train_minutes=budget_s / 60)
    summary = run_train(dataclasses.replace(cfg, run_dir=str(out / "areal")), progress=False)
    seconds = summary["steps"] * samples / max(summary["samples_per_s"], 1e-9)  # the training steps' time
    return {
        "steps": summary["steps"],
        "seconds": seconds,
        "seconds_per_step": seconds / max(summary["steps"], 1),
        "samples_per_s": summary["samples_per_s"],
        "trained_samples_per_s_update_only": summary["trained_samples_per_s"],
        "run_train_accuracy_after": summary["accuracy_after"],
        "model": str(Path(summary["checkpoint"]) / "model"),
        "lr": cfg.ppo.lr,
    }


# ---- the same held-out measurement for every model ------------------------------------------------------------


async def held_out_accuracy(cfg: TrainConfig, model_dir: str | Path) -> float:
    """Greedy accuracy of ``model_dir`` on the recipe's held-out problems, exactly as `run_train` measures it."""
    r = cfg.rollout
    tokenizer = load_tokenizer(model_dir)
    engine = HFEngine(load_model(model_dir, cfg.model.dtype), seed=cfg.seed)
    agent = ChatAgent(
        engine, tokenizer, SamplingParams(r.max_new_tokens, temperature=0.0), system_prompt=r.system_prompt
    )
    backend = await open_checked_backend(cfg.env, cfg.eval)
    try:
        seeds = await held_out_seeds(backend, cfg.eval)
        result = await evaluate(agent, lambda: backend.make(**cfg.eval.env_kwargs), seeds, r.max_concurrent_rollouts)
    finally:
        await backend.aclose()
        await engine.aclose()
    return result["accuracy"]


def quiet() -> None:
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", message=r".*gradient_checkpointing` is deprecated", category=FutureWarning)


def _quietly(fn, *args):  # noqa: ANN001, ANN202
    quiet()
    return fn(*args)


def in_fresh_process(fn, *args):  # noqa: ANN001, ANN202
    """``fn(*args)`` in a new interpreter, as each tool runs for its users: neither trainer inherits the
    other's threads, OpenMP teams or allocator state (TRL training in this process first left an
    OpenMP team that slowed our threads down, and would do the same to TRL in the other order)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_quietly, fn, *args).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench_vs_trl")
    parser.add_argument("--sft-model", default="", help="reuse this SFT checkpoint instead of building one")
    parser.add_argument("--sft-steps", type=int, default=None, help="override sft.yaml's steps when building")
    parser.add_argument("--minutes", type=float, default=4.0, help="wall budget of training steps, per trainer")
    parser.add_argument("--lr", type=float, default=None, help="learning rate of both (default: rl.yaml's)")
    parser.add_argument("--trl-lr", type=float, default=None, help="TRL's learning rate only (default: --lr)")
    parser.add_argument("--steps", type=int, default=0, help="run both for exactly this many steps (no budget)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="rl.yaml override, both")
    args = parser.parse_args()
    quiet()
    out = Path(args.out)
    budget_s = 60 * args.minutes

    sft_model = Path(args.sft_model) if args.sft_model else build_sft(out, args.seed, args.sft_steps)
    overrides = [f"model.path={sft_model}", f"seed={args.seed}", *args.set]
    if args.lr is not None:
        overrides.append(f"ppo.lr={args.lr}")
    cfg = load_config(TrainConfig, RECIPE / "rl.yaml", overrides)
    r = cfg.rollout
    trl_lr = args.trl_lr if args.trl_lr is not None else cfg.ppo.lr

    trl_result = in_fresh_process(run_trl, cfg, budget_s, out, trl_lr, args.steps)
    ours = in_fresh_process(run_areal, cfg, budget_s, out, args.steps)
    start = asyncio.run(held_out_accuracy(cfg, sft_model))
    trl_result["accuracy"] = asyncio.run(held_out_accuracy(cfg, trl_result["model"]))
    ours["accuracy"] = asyncio.run(held_out_accuracy(cfg, ours["model"]))

    settings = {
        "sft_model": str(sft_model),
        "prompts_per_step": r.batch_size,
        "group_size": r.group_size,
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "budget_seconds": None if args.steps else budget_s,
        "steps": args.steps or None,
        "held_out_problems": cfg.eval.num_problems,
        "overrides": overrides,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
    }
    ratio = ours["samples_per_s"] / max(trl_result["samples_per_s"], 1e-9)
    gain = 100 * (ours["accuracy"] - trl_result["accuracy"])
    budget = f"{args.steps} steps" if args.steps else f"{budget_s:.0f} s budget"
    print(
        f"\n== bench/vs_trl: {r.batch_size} prompts x {r.group_size} samples, {r.max_new_tokens} new tokens, "
        f"temperature {r.temperature}, {budget} each, held-out {cfg.eval.num_problems} problems, seed {args.seed} =="
    )
    for name, res in (("TRL GRPOTrainer", trl_result), ("areal-agents   ", ours)):
        print(
            f"{name} : {res['seconds_per_step']:.3f} s/step | {res['samples_per_s']:.0f} trained samples/s | "
            f"held-out {res['accuracy']:.1%} after {res['seconds']:.0f} s (from {start:.1%}) "
            f"[{res['steps']} steps, lr {res['lr']:g}]"
        )
    print(f"ratio samples/s areal/TRL = {ratio:.1f}x | accuracy {gain:+.1f} points")
    print("(samples/s: completions per second of training-step time, rollout + update; start-up and evals excluded)")
    report = {"settings": settings, "start_accuracy": start, "trl": trl_result, "areal": ours}
    report |= {"ratio_samples_per_s": ratio, "accuracy_gain_points": gain}
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_trl.json").write_text(json.dumps(report, indent=2))
    print(f"figures: {out / 'vs_trl.json'}")


if __name__ == "__main__":
    main()
