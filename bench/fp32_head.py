"""The float32 LM head's cost against the bfloat16 head it replaced, forward + backward, same run (CPU).

    .venv/bin/python bench/fp32_head.py [--tokens 1024 --hidden 512 --vocab 32000 --repeats 3]

Token logprobs of random hidden states through a bfloat16 ``nn.Linear`` head, as the trainer scores them
(`chunked_token_logprobs`, token chunks of 1024): the float32 head (hidden and weight upcast, vocabulary
chunks, a backward that recomputes each chunk's logits), and the former path (the head under bfloat16
autocast, a float32 log-softmax of its logits, each token chunk under activation checkpointing; a head that
is not an ``nn.Linear`` still takes it). Also each one's largest error against float64 from the same inputs.
"""

from __future__ import annotations

import argparse
import time

import torch

from areal_agents.models.logprobs import chunked_token_logprobs


def run(hidden: torch.Tensor, head: torch.nn.Linear, tokens: torch.Tensor, fp32: bool) -> tuple[float, torch.Tensor]:
    """Seconds of one forward + backward, and the logprobs."""
    h = hidden.detach().requires_grad_()
    head.zero_grad()
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scorer = head if fp32 else (lambda x: head(x))  # not an nn.Module: the former bfloat16 path
        logp = chunked_token_logprobs(h, scorer, tokens, 1.0)
    logp.sum().backward()
    return time.perf_counter() - start, logp.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).bfloat16()
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False).bfloat16()
    tokens = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    ref = torch.log_softmax(hidden.double() @ head.weight.double().T, -1).gather(1, tokens[:, None]).squeeze(1)
    times: dict[str, list[float]] = {"bf16 head": [], "fp32 head": []}
    errors = {}
    for _ in range(args.repeats):  # interleaved, so that a busy neighbour slows both alike
        for name in times:
            seconds, logp = run(hidden, head, tokens, fp32=name == "fp32 head")
            times[name].append(seconds)
            errors[name] = (logp.double() - ref).abs().max().item()
    print(f"{args.tokens} tokens, hidden {args.hidden}, vocab {args.vocab}; forward + backward, best of {args.repeats}")
    for name, values in times.items():
        print(f"{name:10s} {min(values) * 1e3:8.1f} ms   max |logp - float64| {errors[name]:.1e}")
    print(f"fp32 / bf16 time: {min(times['fp32 head']) / min(times['bf16 head']):.2f}x")


if __name__ == "__main__":
    main()
