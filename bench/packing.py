"""Training tokens/s with packed micro-batches vs padded ones, on a long-tail length batch, same run.

    .venv/bin/python bench/packing.py [--trajectories 256 --median 64 --cap 1024 --budget 8192]
                                      [--group-size 16 --prompt-median 128]

One forward + backward of the token logprobs (what a PPO step costs) over the same trajectories:
packed (first-fit-decreasing into rows of <= budget tokens, attention within each trajectory, no
padding), padded (every micro-batch padded to the batch's longest trajectory, as a plain padded
batch), and length-sorted padded (our former scheme). Target (issue 7): packed >= 1.6x padded.

Then GRPO-shaped data (the same trajectory count in groups of ``--group-size`` sharing a prompt of
median ``--prompt-median`` tokens, long-tail completions): packed with ``share_prompts`` (each prompt
once per row) against packed without it.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import transformers

from areal_agents.models import load_model, save_tiny_model
from areal_agents.trainers.batching import _collate, make_micro_batches, token_logprobs
from areal_agents.types import Trajectory


def long_tail(n: int, median: int, cap: int, rng: random.Random) -> list[Trajectory]:
    out = []
    for _ in range(n):
        length = max(8, min(cap, int(median * rng.lognormvariate(0, 1.0))))
        prompt = min(16, length // 2)
        ids = [rng.randrange(4, 90) for _ in range(length)]
        out.append(Trajectory(ids, [0] * prompt + [1] * (length - prompt), [0.0] * length, [-1] * length))
    return out


def grpo_groups(n: int, group: int, prompt_median: int, median: int, cap: int, rng: random.Random) -> list:
    out = []
    for _ in range(max(1, n // group)):
        prompt = [
            rng.randrange(4, 90) for _ in range(max(4, min(cap // 2, int(prompt_median * rng.lognormvariate(0, 0.5)))))
        ]
        for _ in range(group):
            completion = [
                rng.randrange(4, 90)
                for _ in range(max(1, min(cap - len(prompt), int(median * rng.lognormvariate(0, 1.0)))))
            ]
            ids = prompt + completion
            out.append(Trajectory(ids, [0] * len(prompt) + [1] * len(completion), [0.0] * len(ids), [-1] * len(ids)))
    return out


def padded_to_longest(trajs: list[Trajectory], budget: int) -> list:
    longest = max(len(t) for t in trajs)
    rows = max(1, budget // longest)
    return [
        _collate(trajs[i : i + rows], [1.0] * len(trajs[i : i + rows]), list(range(i, i + rows)), 0)
        for i in range(0, len(trajs), rows)
    ]


def tokens_per_s(model, batches, real_tokens: int, repeats: int) -> float:
    model.train()
    start = time.perf_counter()
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        for mb in batches:
            logp = token_logprobs(model, mb, 1.0)
            (-(logp * mb.loss_mask).sum()).backward()
    return real_tokens * repeats / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--median", type=int, default=64)
    parser.add_argument("--cap", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--prompt-median", type=int, default=128)
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = save_tiny_model(
        tempfile.mkdtemp(prefix="bench-pack-"),
        hidden_size=args.hidden,
        num_layers=args.layers,
        intermediate_size=2 * args.hidden,
        max_position_embeddings=max(512, args.cap),
    )
    model = load_model(path)
    trajs = long_tail(args.trajectories, args.median, args.cap, random.Random(0))
    real = sum(len(t) for t in trajs)
    schemes = {
        "packed": make_micro_batches(trajs, args.budget, pack=True),
        "padded": padded_to_longest(trajs, args.budget),
        "length-sorted padded": make_micro_batches(trajs, args.budget, pack=False),
    }
    print(
        f"== bench/packing == {len(trajs)} trajectories, {real} tokens (median {args.median}, "
        f"longest {max(len(t) for t in trajs)}), budget {args.budget} tokens per micro-batch"
    )
    rates = {}
    for name, batches in schemes.items():
        tokens_per_s(model, batches[:1], real, 1)  # warm-up
        rates[name] = tokens_per_s(model, batches, real, args.repeats)
        cells = sum(mb.input_ids.numel() for mb in batches)
        print(
            f"{name:22s} {rates[name]:8.0f} real tokens/s  ({len(batches):3d} micro-batches, "
            f"{cells / real:4.2f}x cells per real token) = {rates[name] / rates['packed']:.2f}x packed"
        )
    print(f"packed vs padded: {rates['packed'] / rates['padded']:.2f}x")

    groups = grpo_groups(
        args.trajectories, args.group_size, args.prompt_median, args.median, args.cap, random.Random(1)
    )
    real = sum(len(t) for t in groups)
    print(
        f"== GRPO groups == {len(groups) // args.group_size} prompts x {args.group_size}, {real} trajectory tokens "
        f"(prompt median {args.prompt_median}, completion median {args.median})"
    )
    shared_rates = {}
    for name, share in (("packed", False), ("packed, shared prompts", True)):
        batches = make_micro_batches(groups, args.budget, pack=True, share_prompts=share)
        tokens_per_s(model, batches[:1], real, 1)
        shared_rates[name] = tokens_per_s(model, batches, real, args.repeats)
        run = sum(mb.num_tokens for mb in batches)
        print(
            f"{name:22s} {shared_rates[name]:8.0f} trajectory tokens/s  ({len(batches):3d} micro-batches, "
            f"{run / real:4.2f}x tokens run per trajectory token)"
        )
    print(f"shared prompts vs packed: {shared_rates['packed, shared prompts'] / shared_rates['packed']:.2f}x")


if __name__ == "__main__":
    main()
