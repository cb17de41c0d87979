"""Write SFT demonstrations for the arithmetic recipe: train-split problems with their answers.

python examples/arithmetic/make_sft_data.py runs/arith/sft_data.jsonl --n 5000
"""

import argparse
import json
from pathlib import Path

import numpy as np

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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for _ in range(args.n):
            p = sample_problem(rng, args.digits, args.operators, split="train")  # never a test problem
            messages = [{"role": "user", "content": p.text}, {"role": "assistant", "content": str(p.answer)}]
            f.write(json.dumps({"messages": messages}) + "\n")
    print(f"{args.n} conversations written to {out}")


if __name__ == "__main__":
    main()
