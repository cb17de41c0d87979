"""Write SFT demonstrations for the arithmetic recipe: train-split problems with their answers.

python examples/arithmetic/make_sft_data.py runs/arith/sft_data.jsonl --n 5000
"""

import argparse

import numpy as np

from areal_agents.data import write_chat_jsonl
from areal_agents.envs.arithmetic import sample_problem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--n", type=int, default=5000, help="conversations")
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--operators", default="+")
    parser.add_argument("--seed", type=int, default=12345)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    problems = (sample_problem(rng, args.digits, args.operators, split="train") for _ in range(args.n))  # no test one
    conversations = (
        [{"role": "user", "content": p.text}, {"role": "assistant", "content": str(p.answer)}] for p in problems
    )
    print(f"{write_chat_jsonl(args.out, conversations)} conversations written to {args.out}")


if __name__ == "__main__":
    main()
