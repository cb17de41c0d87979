"""Part t of the device check (bench/gpu_check.py): serve-tinker's trainer and sampler on the GPU, as
``serve-tinker --device cuda`` opens them (a `TinkerService` over a `TinkerTrainer` and its engine per base).

A LoRA training model on the preset model learns two texts (the loss must fall), a sampler of it runs on the
service's engine, and the engine's logprobs of its samples are compared with the trainer's forward on the
same tokens (the engine computes in bf16 on CUDA, the trainer in float32: the gap is what a Tinker RL loop's
importance ratios see at ratio 1).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from gpu_check_parts import model_dir

from areal_agents.models import load_tokenizer
from areal_agents.tinker.backend import TinkerService
from areal_agents.tinker.ownership import BaseModels
from areal_agents.tinker.sampler import SampleParams
from areal_agents.tinker.training import TinkerTrainer

TEXTS = ["the quick brown fox jumps over the lazy dog", "one two three four five six seven eight nine ten"]
STEPS, SAMPLES, NEW_TOKENS = 8, 8, 24
MAX_MEAN_GAP = 0.05  # mean |engine logprob - trainer logprob| over the sampled tokens


def datums(tokens: list[list[int]]) -> list:
    """Each token list as next-token cross-entropy datum, every target of weight 1."""
    return [(t[:-1], {"target_tokens": torch.tensor(t[1:]), "weights": torch.ones(len(t) - 1)}) for t in tokens]


def part_t(ctx, cap) -> None:
    """serve-tinker on the GPU: the loss of a training model falls, its sampler's logprobs match the trainer's."""
    r = ctx.report
    base = model_dir(ctx)
    trainer = TinkerTrainer(device=str(ctx.device))
    service = TinkerService(BaseModels({"gpu": base}), ctx.work / "tinker", trainer, engine_device=str(ctx.device))
    cap.closing(lambda: ctx.loop.run_until_complete(service.close()))
    tokenizer = load_tokenizer(base)
    train = datums([tokenizer.encode(text) for text in TEXTS])
    trainer.create_model("t", str(base), 16, seed=0)
    losses = []
    for step in range(STEPS):
        cap.check(f"training step {step}")
        losses.append(trainer.forward_backward("t", train, "cross_entropy").metrics["loss:sum"])
        trainer.optim_step("t", learning_rate=1e-3)
    r.check("t", "train_loss_falls", losses[-1] < 0.9 * losses[0], first=losses[0], last=losses[-1], steps=STEPS)

    cap.check("sampling")
    snapshot = trainer.sampler_snapshot("t")
    prompt = tokenizer.encode(TEXTS[0])[:4]
    params = SampleParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=0)

    async def sample():
        engine = await service.engine(str(Path(base).resolve()))
        await engine.set_lora_adapter("t", snapshot.tensors, snapshot.config)
        return await trainer.sample(engine, "t", snapshot, prompt, params, SAMPLES, prompt_logprobs=True)

    out = ctx.loop.run_until_complete(sample())
    sampled = datums([prompt + s.tokens for s in out.sequences])
    scored = trainer.forward_backward("t", sampled, "cross_entropy", forward_only=True)
    gaps = [
        abs(a - b)
        for seq, lp in zip(out.sequences, scored.logprobs)
        for a, b in zip(seq.logprobs, lp[len(prompt) - 1 :].tolist())
    ]
    mean_gap = sum(gaps) / max(len(gaps), 1)
    r.check(
        "t",
        "sampler_logprobs_match_trainer",
        bool(gaps) and math.isfinite(mean_gap) and mean_gap < MAX_MEAN_GAP,
        mean_abs=mean_gap,
        max_abs=max(gaps, default=float("nan")),
        tokens=len(gaps),
        limit=MAX_MEAN_GAP,
        prompt_logprobs=out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt),
    )
