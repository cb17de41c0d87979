"""What token-exactness costs per turn: `ChatTokens.append_messages` (the whole conversation rendered and
tokenized again, accepted only if it extends the tokens so far) against the bookkeeping it replaced (the new
messages' text found by comparing two renders, only it tokenized), alternated in one process.

    .venv/bin/python bench/chat_tokens.py [--family qwen3] [--turns 8 32] [--episodes 40]

Prints milliseconds per turn of each and their ratio, per conversation length. Texts differ per episode, so
the tokenize cache does not hide the work (a GRPO group's shared prompt would hit it).
"""

from __future__ import annotations

import argparse
import random
import time

from areal_agents.agents.chat_tokens import ChatTokens
from areal_agents.models.families import build_family_tokenizer
from areal_agents.models.tiny import build_tiny_tokenizer


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(["the", "answer", "is", "12", "+", "34", "so", "we", "add", "carry"]) for _ in range(n))


def suffix_only(chat: ChatTokens, messages: list[dict]) -> None:
    """The replaced bookkeeping: the text after the old render, tokenized alone (no check against the tokens)."""
    old = chat._render(chat.messages, generation_prompt=False)
    new = chat._render([*chat.messages, *messages], generation_prompt=True)
    chat._extend_prompt(chat._encode(new[len(old) :]))
    chat.messages = [*chat.messages, *messages]


def episode(tokenizer, seed: int, turns: int, exact: bool) -> float:
    """Seconds spent appending observations over one episode of ``turns`` turns."""
    rng = random.Random(seed)
    chat = ChatTokens(tokenizer)
    chat.start([{"role": "system", "content": words(rng, 40)}, {"role": "user", "content": words(rng, 30)}])
    spent = 0.0
    for _ in range(turns):
        ids = tokenizer.encode(words(rng, 60), add_special_tokens=False) + [chat.stop_ids[0]]
        chat.append_generation(ids, [0.0] * len(ids), [0] * len(ids))
        observation = [{"role": "user", "content": words(rng, 30)}]
        t = time.perf_counter()
        appended = chat.append_messages(observation) if exact else suffix_only(chat, observation) is None
        spent += time.perf_counter() - t
        if not appended:
            raise SystemExit("the template rewrote history: pick a family whose user turns extend (char, granite)")
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="char", help="char or a family whose user turns extend (granite)")
    parser.add_argument("--turns", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--episodes", type=int, default=40)
    args = parser.parse_args()
    tokenizer = build_tiny_tokenizer() if args.family == "char" else build_family_tokenizer(args.family)
    for turns in args.turns:
        spent = {True: 0.0, False: 0.0}
        for k in range(args.episodes):
            for exact in (k % 2 == 0, k % 2 == 1):  # alternated: both see the same machine noise
                spent[exact] += episode(tokenizer, seed=1000 * turns + k, turns=turns, exact=exact)
        per_turn = {e: 1000 * s / (args.episodes * turns) for e, s in spent.items()}
        print(
            f"{args.family}, {turns} turns: exact check {per_turn[True]:.2f} ms/turn, suffix only "
            f"{per_turn[False]:.2f} ms/turn ({per_turn[True] / per_turn[False]:.2f}x)"
        )


if __name__ == "__main__":
    main()
