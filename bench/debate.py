"""Debate vs a single agent with the same model and the same number of generated answers, before and after RL.

    .venv/bin/python bench/debate.py --sft-model runs/arith/sft/model [--rl-steps 60] [--problems 200]

The debate (``examples/debate/rl.yaml``: 2 debaters, 2 rounds, greedy) is scored by the majority of the
final answers. The single agent gets the same model and as many answers (debaters x rounds, sampled at the
rollout temperature) and answers by majority vote (self-consistency); its greedy accuracy is shown too.
Both are measured on the same held-out problems with the SFT model and again after ``--rl-steps`` steps of
shared-policy debate RL. Prints accuracy and generated tokens per problem for each.
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from pathlib import Path

import transformers

from areal_agents.agents import ChatAgent
from areal_agents.agents.multi_agent import MultiAgentChatAgent
from areal_agents.config import TrainConfig, load_config
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.envs.runtime.pool import LocalEnvPool
from areal_agents.models import load_model, load_tokenizer
from areal_agents.rollout.episodes import run_groups
from areal_agents.rollout.held_out import distinct_seeds
from areal_agents.trainers.rl_recipe import run_train
from areal_agents.types import SamplingParams

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "debate" / "rl.yaml"


async def measure(model_dir: str, cfg: TrainConfig, problems: int) -> dict[str, float]:
    """Debate (greedy, majority of final answers) vs single agent (greedy; majority of k samples)."""
    tokenizer = load_tokenizer(model_dir)
    engine = HFEngine(load_model(model_dir), seed=cfg.seed)
    pool = LocalEnvPool("inline")
    env_kwargs = {**cfg.env.kwargs, **cfg.eval.env_kwargs}
    task_id, task_kwargs = env_kwargs["task_env"], env_kwargs["task_kwargs"]
    k = env_kwargs["num_agents"] * env_kwargs["rounds"]
    tokens = cfg.rollout.max_new_tokens
    try:
        seeds = await distinct_seeds(lambda: pool.make(task_id, **task_kwargs), problems, start=cfg.eval.seed)
        debate = MultiAgentChatAgent(engine, tokenizer, SamplingParams(tokens, temperature=0.0))
        groups = await run_groups(debate, lambda: pool.make(cfg.env.id, **env_kwargs), seeds, 1, tag="debate")
        debate_right = [bool(g[0].metadata.get("success")) for g in groups]
        debate_tokens = sum(t.num_generated for g in groups for t in g)

        greedy = ChatAgent(engine, tokenizer, SamplingParams(tokens, temperature=0.0))
        groups = await run_groups(greedy, lambda: pool.make(task_id, **task_kwargs), seeds, 1, tag="greedy")
        greedy_right = [g[0].reward >= 1.0 for g in groups]

        sampler = ChatAgent(engine, tokenizer, SamplingParams(tokens, temperature=cfg.rollout.temperature))
        groups = await run_groups(sampler, lambda: pool.make(task_id, **task_kwargs), seeds, k, tag="vote")
        vote_right = []
        for g in groups:
            answers = [t.metadata["messages"][-1]["content"].strip() for t in g]
            majority = Counter(answers).most_common(1)[0][0]  # ties: the first seen
            vote_right.append(any(t.reward >= 1.0 and a == majority for t, a in zip(g, answers)))
        vote_tokens = sum(t.num_generated for g in groups for t in g)
    finally:
        await engine.aclose()
    n = len(seeds)
    return {
        "debate": sum(debate_right) / n,
        "debate_tokens": debate_tokens / n,
        "single_vote": sum(vote_right) / n,
        "single_vote_tokens": vote_tokens / n,
        "single_greedy": sum(greedy_right) / n,
        "answers": k,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-model", required=True, help="the arithmetic SFT model (bench/e2e_arith.py)")
    parser.add_argument("--rl-steps", type=int, default=60)
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--out", default="runs/bench_debate")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    overrides = [f"model.path={args.sft_model}", f"run_dir={args.out}/rl", f"steps={args.rl_steps}"]
    overrides += [f"seed={args.seed}", f"eval.num_problems={args.problems}"]
    cfg = load_config(TrainConfig, RECIPE, overrides)
    before = asyncio.run(measure(args.sft_model, cfg, args.problems))
    summary = run_train(cfg, progress=False)
    after = asyncio.run(measure(str(Path(summary["checkpoint"]) / "model"), cfg, args.problems))
    print(f"\n== bench/debate: {args.problems} held-out problems, {args.rl_steps} steps of shared-policy debate RL ==")
    for label, r in (("before RL", before), ("after RL", after)):
        print(
            f"{label:9}: debate {r['debate']:6.1%} ({r['debate_tokens']:.1f} tokens/problem) | "
            f"single agent, majority of {r['answers']} {r['single_vote']:6.1%} ({r['single_vote_tokens']:.1f} "
            f"tokens/problem) | single agent greedy {r['single_greedy']:6.1%}"
        )


if __name__ == "__main__":
    main()
