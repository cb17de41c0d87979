"""Write SFT demonstrations for the count recipe: train-split counts with their answers.

python examples/count/make_sft_data.py runs/count/sft_data.jsonl --n 20000
"""

import argparse

import numpy as np

from areal_agents.data import write_chat_jsonl
from areal_agents.envs.count import sample_count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--n", type=int, default=20000, help="conversations")
    parser.add_argument("--median-length", type=int, default=6)
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--start-below", type=int, default=100)
    parser.add_argument("--seed", type=int, default=12345)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    counts = (
        sample_count(rng, args.start_below, args.median_length, args.sigma, args.max_length, split="train")
        for _ in range(args.n)
    )
    conversations = ([{"role": "user", "content": c.text}, {"role": "assistant", "content": c.answer}] for c in counts)
    print(f"{write_chat_jsonl(args.out, conversations)} conversations written to {args.out}")


if __name__ == "__main__":
    main()
