"""serve-tinker against the project's own loop on the same work: LoRA training tokens/s and sampling samples/s.

    .venv/bin/python bench/serve_tinker.py [--rounds 2] [--steps 8] [--batch 64] [--tokens 64] [--rank 16]
                                           [--nproc-per-node 2]

Training: each step is ``--batch`` sequences of ``--tokens`` tokens (the second half sampled, advantages +-1 in
groups of 8) on the tiny model with a rank ``--rank`` LoRA adapter. serve-tinker: the ``tinker`` SDK's
``forward_backward(importance_sampling)`` + ``optim_step`` over HTTP to a ``serve-tinker`` process; ours:
`Policy.update` (the trainer ``areal-agents train`` runs, decoupled PPO with one minibatch) in this process, given
as many threads as serve-tinker's (a run gives its trainer the cores less the event loop's).
Sampling: ``--batch`` prompts x 4 samples of ``--tokens // 2`` tokens (EOS ignored); serve-tinker: the SDK's
``sample`` on a sampler of the adapter; ours: `HFEngine.agenerate` with the same adapter in this process.
``--nproc-per-node N`` adds serve-tinker training on N FSDP2 ranks (its samplers are the same engine's).
Modes alternate ``--rounds`` times; each figure is the median of its rounds, after one warm-up step.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal_agents.config import LoraConfig, TrainConfig, load_config  # noqa: E402
from areal_agents.engines.hf.engine import HFEngine  # noqa: E402
from areal_agents.models import load_model  # noqa: E402
from areal_agents.models.tiny import save_tiny_model  # noqa: E402
from areal_agents.trainers.policy import load_trainable  # noqa: E402
from areal_agents.trainers.policy_api import TrainSpec  # noqa: E402
from areal_agents.types import GenRequest, SamplingParams, Trajectory  # noqa: E402
from tests.tinker.tinker_process import CLIENT_ENV, serve_tinker  # noqa: E402

SAMPLES = 4  # per prompt


def work(batch: int, tokens: int, vocab: int, seed: int = 0) -> list[Trajectory]:
    """``batch`` sequences: a prompt, then ``tokens // 2`` sampled tokens with logprob -2 and reward 0/1 by turns."""
    g = torch.Generator().manual_seed(seed)
    half = tokens // 2
    out = []
    for i in range(batch):
        ids = torch.randint(10, vocab, (tokens,), generator=g).tolist()
        mask = [0] * (tokens - half) + [1] * half
        out.append(
            Trajectory(
                ids,
                mask,
                [0.0] * (tokens - half) + [-2.0] * half,
                [-1] * (tokens - half) + [0] * half,
                float(i % 2),
                f"g{i // 8}",
            )
        )
    return out


def tinker_datums(trajectories: list[Trajectory]) -> list:
    """The same sequences as Tinker datums: input tokens[:-1], targets tokens[1:], group-centred advantages."""
    from tinker import types

    out = []
    for t in trajectories:
        adv = 1.0 if t.reward > 0.5 else -1.0
        inputs = {
            "target_tokens": t.input_ids[1:],
            "logprobs": t.logprobs[1:],
            "advantages": [adv * m for m in t.loss_mask[1:]],
        }
        out.append(types.Datum(model_input=types.ModelInput.from_ints(t.input_ids[:-1]), loss_fn_inputs=inputs))
    return out


def time_steps(step, steps: int) -> float:
    """Seconds per step, after one warm-up step."""
    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def tinker_modes(base: Path, args, trajectories, nproc: int = 1) -> tuple[float, float]:
    """(train s/step, sample s/round) through the SDK against a serve-tinker process training on ``nproc`` ranks."""
    import tinker
    from tinker import types

    with (
        tempfile.TemporaryDirectory(prefix="bench-tinker-") as root,
        serve_tinker(Path(root), {"bench": base}, nproc) as url,
    ):
        os.environ.update({"TINKER_BASE_URL": url, **CLIENT_ENV})
        with tinker.ServiceClient() as service:
            training = service.create_lora_training_client(  # every linear layer but the head, as ours
                base_model="bench", rank=args.rank, seed=0, train_unembed=False
            ).result()
            data, adam = tinker_datums(trajectories), types.AdamParams(learning_rate=1e-4)

            def train_step() -> None:
                fb, opt = training.forward_backward(data, "importance_sampling"), training.optim_step(adam)
                fb.result(timeout=600), opt.result(timeout=600)

            train = time_steps(train_step, args.steps)
            sampler = training.save_weights_and_get_sampling_client().result()
            params = types.SamplingParams(max_tokens=args.tokens // 2, temperature=1.0, stop=[])
            prompts = [types.ModelInput.from_ints(t.input_ids[: args.tokens // 2]) for t in trajectories]

            def sample_round() -> None:
                futures = [sampler.sample(p, num_samples=SAMPLES, sampling_params=params) for p in prompts]
                assert all(len(f.result(timeout=600).sequences) == SAMPLES for f in futures)

            return train, time_steps(sample_round, max(1, args.steps // 4))


def our_modes(base: Path, args, trajectories) -> tuple[float, float]:
    """(train s/step, sample s/round) with the project's own trainer and engine in this process."""
    cfg = load_config(TrainConfig, ROOT / "examples/arithmetic/rl.yaml", [f"model.path={base}"])
    lora = LoraConfig(r=args.rank, alpha=2 * args.rank)
    spec = replace(TrainSpec.of(cfg, pad_token_id=0), lora=lora, cpu_threads=torch.get_num_threads())
    policy = load_trainable("policy", spec, str(base), str(base))
    generator = torch.Generator().manual_seed(0)
    train = time_steps(lambda: asyncio.run(policy.update(trajectories, generator)), args.steps)
    adapter, config = asyncio.run(policy.tensors()), policy.adapter_config()
    policy.close()

    async def sample_all() -> float:
        engine = HFEngine(load_model(base))
        await engine.set_lora_adapter("bench", adapter, config)
        params = SamplingParams(max_new_tokens=args.tokens // 2, temperature=1.0, ignore_eos=True)
        requests = [t.input_ids[: args.tokens // 2] for t in trajectories]

        async def one_round() -> None:
            gen = [
                GenRequest(f"r{i}-{k}-{time.perf_counter_ns()}", p, params, lora_name="bench")
                for i, p in enumerate(requests)
                for k in range(SAMPLES)
            ]
            await asyncio.gather(*(engine.agenerate(r) for r in gen))

        await one_round()
        start, rounds = time.perf_counter(), max(1, args.steps // 4)
        for _ in range(rounds):
            await one_round()
        engine.close()
        return (time.perf_counter() - start) / rounds

    return train, asyncio.run(sample_all())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed training steps a round (sampling: a quarter)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--nproc-per-node", type=int, default=1, help="also serve-tinker on this many FSDP2 ranks")
    args = parser.parse_args()
    trajectories = work(args.batch, args.tokens, vocab=100)
    ranked = f"{args.nproc_per_node} ranks"
    figures: dict[str, list[tuple[float, float]]] = {"serve-tinker": [], "ours": []}
    if args.nproc_per_node > 1:
        figures[ranked] = []
    with tempfile.TemporaryDirectory(prefix="bench-tinker-base-") as tmp:
        base = save_tiny_model(Path(tmp) / "tiny")
        for _ in range(args.rounds):
            figures["serve-tinker"].append(tinker_modes(base, args, trajectories))
            figures["ours"].append(our_modes(base, args, trajectories))
            if args.nproc_per_node > 1:
                figures[ranked].append(tinker_modes(base, args, trajectories, args.nproc_per_node))
    tokens, samples = args.batch * args.tokens, args.batch * SAMPLES
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.machine())  # fmt: skip
    print(
        f"== bench/serve_tinker ({cpu}, {os.cpu_count()} cores, torch {torch.__version__}; {args.batch} x "
        f"{args.tokens} tokens a step, LoRA rank {args.rank}, {args.rounds} alternated rounds) =="
    )
    rate = {}
    for mode, rows in figures.items():
        train, sample = (statistics.median(col) for col in zip(*rows))
        rate[mode] = (tokens / train, samples / sample)
        print(
            f"{mode:>12}: train {rate[mode][0]:8.0f} tokens/s ({train * 1000:.0f} ms a step)  "
            f"sample {rate[mode][1]:6.1f} samples/s ({samples} x {args.tokens // 2} tokens in {sample:.2f} s)"
        )
    print(
        f"serve-tinker / ours: train {rate['serve-tinker'][0] / rate['ours'][0]:.2f}x  "
        f"sample {rate['serve-tinker'][1] / rate['ours'][1]:.2f}x"
    )
    if ranked in rate:
        print(f"serve-tinker {ranked} / one process: train {rate[ranked][0] / rate['serve-tinker'][0]:.2f}x")


if __name__ == "__main__":
    main()
