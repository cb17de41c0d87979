"""SFT demonstrations for the debate recipe: half single-turn problems, half two-round debates whose second
round shows another debater's answer (right or wrong, even odds) and answers correctly.

python examples/debate/make_sft_data.py runs/debate/sft_data.jsonl --n 20000

The tiny CPU model only knows what it was shown: without debate-shaped turns in its warm start, it answers
the round-2 prompt with noise, and RL has almost no reward to learn from.
"""

import argparse

import numpy as np

from areal_agents.data import write_chat_jsonl
from areal_agents.envs.arithmetic import sample_problem
from areal_agents.envs.debate import ROUND_PROMPT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--n", type=int, default=20000, help="conversations")
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--seed", type=int, default=12345)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)

    def conversation(i: int) -> list[dict[str, str]]:
        p = sample_problem(rng, args.digits, "+", split="train")  # never a test problem
        messages = [{"role": "user", "content": p.text}, {"role": "assistant", "content": str(p.answer)}]
        if i % 2:
            peer = p.answer if rng.random() < 0.5 else p.answer + int(rng.choice([-10, -1, 1, 10]))
            shown = ROUND_PROMPT.format(answers=f"debater_{int(rng.integers(2))}: {peer}", question=p.text)
            messages += [{"role": "user", "content": shown}, {"role": "assistant", "content": str(p.answer)}]
        return messages

    n = write_chat_jsonl(args.out, (conversation(i) for i in range(args.n)))
    print(f"{n} conversations written to {args.out}")


if __name__ == "__main__":
    main()
