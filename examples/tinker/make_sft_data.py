"""Write SFT conversations in tinker-cookbook's arithmetic form: its few-shot turn, then "What is x + y?" and
the sum (x, y in 0..100, as `tinker_cookbook.recipes.math_rl.arithmetic_env` asks them).

python examples/tinker/make_sft_data.py runs/tinker/sft_data.jsonl --n 20000
"""

import argparse

import numpy as np

from areal_agents.data import write_chat_jsonl

FEW_SHOT = [{"role": "user", "content": "What is 4 + 5?"}, {"role": "assistant", "content": "9"}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--n", type=int, default=20000, help="conversations")
    parser.add_argument("--seed", type=int, default=12345)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    pairs = rng.integers(0, 101, size=(args.n, 2)).tolist()
    conversations = (
        [*FEW_SHOT, {"role": "user", "content": f"What is {x} + {y}?"}, {"role": "assistant", "content": str(x + y)}]
        for x, y in pairs
    )
    print(f"{write_chat_jsonl(args.out, conversations)} conversations written to {args.out}")


if __name__ == "__main__":
    main()
