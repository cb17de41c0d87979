"""Accuracy of a serve-tinker sampler on the cookbook's arithmetic prompts, with the tinker SDK and the cookbook's
renderer: the base model, and a recipe run's final weights (its ``checkpoints.jsonl``).

python examples/tinker/evaluate.py --base-url http://127.0.0.1:8000 --model runs/tinker/sft/model --run runs/tinker/rl

The problems are the recipe's (x, y in 0..100, its few-shot turn first), drawn from a seed of their own; each is
answered greedily and at temperature 1 (the recipe's sampling). Needs TINKER_API_KEY (any tml- key).
"""

import argparse
import json
import random
from pathlib import Path

import tinker
from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
from transformers import AutoTokenizer


def accuracy(sampler: tinker.SamplingClient, renderer, problems: list[tuple[int, int]], temperature: float) -> float:
    """The share of ``problems`` answered with exactly their sum."""
    params = tinker.SamplingParams(max_tokens=8, temperature=temperature, stop=renderer.get_stop_sequences(), seed=0)
    futures = []
    for x, y in problems:
        convo = [*ArithmeticEnv.standard_fewshot_prefix(), {"role": "user", "content": f"What is {x} + {y}?"}]
        futures.append(sampler.sample(renderer.build_generation_prompt(convo), 1, params))
    right = 0
    for (x, y), future in zip(problems, futures):
        message, _ = renderer.parse_response(future.result().sequences[0].tokens)
        right += renderers.get_text_content(message).strip() == str(x + y)
    return right / len(problems)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True, help="the base model's name on the server (its directory)")
    parser.add_argument("--run", required=True, help="the recipe's log_path (its checkpoints.jsonl names the weights)")
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    problems = [(rng.randint(0, 100), rng.randint(0, 100)) for _ in range(args.problems)]
    renderer = renderers.get_renderer("qwen3", AutoTokenizer.from_pretrained(args.model))
    final = json.loads((Path(args.run) / "checkpoints.jsonl").read_text().splitlines()[-1])["sampler_path"]
    with tinker.ServiceClient(base_url=args.base_url) as service:
        samplers = {
            "base model": service.create_sampling_client(base_model=args.model).result(),
            "after RL": service.create_sampling_client(model_path=final).result(),
        }
        print(f"accuracy on {args.problems} arithmetic problems (the recipe's form, seed {args.seed}):")
        for name, sampler in samplers.items():
            greedy, sampled = accuracy(sampler, renderer, problems, 0.0), accuracy(sampler, renderer, problems, 1.0)
            print(f"  {name:<10}  greedy {greedy:6.1%}   temperature 1 {sampled:6.1%}")


if __name__ == "__main__":
    main()
