"""The six parts of the device check (bench/gpu_check.py runs them): one function each, `PART[letter](ctx, cap)`.

Each opens what it measures the way a run opens it (`open_policy`, `open_policy_engine`, `run_sft`,
`run_train` on examples/gpu's configs), so the check exercises the code users run, not a copy of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import random
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from engine import engine_rate, prompts_for  # bench/engine.py: the same load as its CPU figures
from gpu_check_stats import MIN_STEPS, slope_interval, step_scalars, verdict

from areal_agents.config import SFTConfig, TrainConfig, load_config
from areal_agents.models import load_model, load_tokenizer, save_tiny_model
from areal_agents.models.device import peak_tflops
from areal_agents.models.loading import pad_token_id
from areal_agents.net import free_port
from areal_agents.trainers.distributed import DataParallel, lm_flops
from areal_agents.trainers.local_launcher import open_policy, open_policy_engine
from areal_agents.trainers.policy import load_trainable
from areal_agents.trainers.policy_api import TrainSpec
from areal_agents.trainers.rl_recipe import run_train
from areal_agents.trainers.sft_recipe import run_sft
from areal_agents.types import GenRequest, SamplingParams, Trajectory

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "gpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_dir(ctx) -> Path:
    """The preset model (qwen3-0.4b on the GPU, a shrunk one in the rehearsal), built once."""
    if ctx.model_dir is None:
        ctx.model_dir = save_tiny_model(
            ctx.work / "model", preset=ctx.sizes.preset, overwrite=True, **ctx.sizes.model_kwargs
        )
    return ctx.model_dir


def train_config(ctx, run_dir: Path, model_path: Path | str, *overrides: str) -> TrainConfig:
    """examples/gpu/rl.yaml on ``model_path``, with this check's device (cpu in the rehearsal)."""
    device = ctx.device.type
    base = [f"run_dir={run_dir}", f"model.path={model_path}", f"ppo.device={device}", f"engine.device={device}"]
    return load_config(TrainConfig, RECIPE / "rl.yaml", [*base, *overrides])


def policy_for(ctx):
    """The trainer a run opens (``open_policy``: FSDP2 and bf16 compute on the GPU) with its in-process engine
    (in_process weight sync), shared by parts a, d and e."""
    if ctx.policy is None:
        path = model_dir(ctx)
        cfg = train_config(ctx, ctx.work / "policy", path)
        ctx.policy = open_policy("policy", cfg, str(path), str(path), ctx.work / "policy")
    return ctx.policy


def close_policy(ctx, policy) -> None:
    policy.close()
    ctx.loop.run_until_complete(policy.engine.aclose())


def matmul_peak(device: torch.device, n: int) -> float:
    """TFLOP/s of an ``n``-cubed bf16 product: 3 warm-ups, then 10 timed (CUDA events on a GPU)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b, out=c)
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            torch.mm(a, b, out=c)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000 / 10
    else:
        t0 = time.perf_counter()
        for _ in range(10):
            torch.mm(a, b, out=c)
        seconds = (time.perf_counter() - t0) / 10
    return 2 * n**3 / seconds / 1e12


def synthetic_groups(sizes, vocab: int, seed: int = 0) -> list[Trajectory]:
    """GRPO groups of random tokens (prompt, then completion), rewards 0/1 alternating within each group,
    behavior logprobs near a fresh model's (uniform over the vocabulary)."""
    rng = random.Random(seed)
    out = []
    p, c = sizes.prompt_tokens, sizes.completion_tokens
    for g in range(sizes.ppo_groups):
        prompt = [rng.randrange(4, vocab) for _ in range(p)]
        for k in range(sizes.group_size):
            completion = [rng.randrange(4, vocab) for _ in range(c)]
            out.append(
                Trajectory(
                    input_ids=prompt + completion,
                    loss_mask=[0] * p + [1] * c,
                    logprobs=[0.0] * p + [-math.log(vocab)] * c,
                    versions=[-1] * p + [0] * c,
                    reward=float(k % 2),
                    group_id=f"g{g}",
                )
            )
    return out


def palm_flops(model, trajectories: list[Trajectory]) -> float:
    """`lm_flops` of the trajectories unshared: 6 x parameters x tokens + 12 x layers x heads x head dim x
    attended positions (causal), forward and backward."""
    tokens = sum(len(t) for t in trajectories)
    attended = sum(len(t) * (len(t) + 1) / 2 for t in trajectories)
    return lm_flops(model, tokens, attended)


def part_a(ctx, cap) -> None:
    """The bf16 matmul peak; then PPO steps of one FSDP2 rank (a multi-GPU run's rank, bf16 mixed precision)
    and of the trainer the single-GPU recipe opens (`open_policy`): tokens/s and MFU against that peak."""
    r, s = ctx.report, ctx.sizes
    peak = matmul_peak(ctx.device, s.matmul_n)
    ctx.measured_peak_tflops = peak
    r.check("a", "matmul_peak", peak > 0, tflops=peak, n=s.matmul_n, table_tflops=peak_tflops(ctx.device))
    cap.check("the FSDP2 PPO step")
    path = model_dir(ctx)
    cfg = train_config(ctx, ctx.work / "fsdp", path)
    spec = TrainSpec.of(cfg, pad_token_id(load_tokenizer(path)))
    dp = fsdp_rank(ctx.device)
    try:
        try:
            sharded = load_trainable("policy", spec, str(path), str(path), dp=dp)
        except Exception as e:  # noqa: BLE001  (FAIL, then measure on a group that takes CPU tensors too)
            if ctx.device.type != "cuda":
                raise
            r.add("a", "FAIL", "fsdp2_trainer", error=f"{type(e).__name__}: {e}", group=f"{dp.backend_name} only")
            dp.close()
            dp = fsdp_rank(ctx.device, backend="cpu:gloo,cuda:nccl")
            sharded = load_trainable("policy", spec, str(path), str(path), dp=dp)
        r.add("a", "INFO", "fsdp2_trainer", fsdp=is_fsdp(sharded.trained), group=dp.backend_name)
        timed_updates(ctx, cap, "fsdp2", sharded.model, lambda t, g: sharded.train_step(t, g), peak)
    finally:
        dp.close()
    sharded = None
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    cap.check("the single-GPU recipe's PPO step")
    policy = policy_for(ctx)
    timed_updates(ctx, cap, "recipe", policy.model, lambda t, g: ctx.loop.run_until_complete(policy.update(t, g)), peak)


def fsdp_rank(device: torch.device, backend: str | None = None):
    """This process as rank 0 of 1, joined torchrun's way (`DataParallel.from_env`: NCCL on a GPU, gloo on the
    CPU); with ``backend``, a group of that backend instead (``cpu:gloo,cuda:nccl``: CPU tensors too)."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    if backend is None:
        dp = DataParallel.from_env(device)
    else:
        torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method="env://", rank=0, world_size=1)
        dp = DataParallel(0, 1, device)
    dp.backend_name = dist.get_backend()
    return dp


def timed_updates(ctx, cap, name: str, model, update, peak: float) -> None:
    """A warm-up update, then two timed ones, each a PASS/FAIL line: tokens/s, MFU against ``peak`` TFLOP/s."""
    r, s = ctx.report, ctx.sizes
    trajectories = synthetic_groups(s, model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    update(trajectories, generator)  # warm-up: the allocator, the kernels
    r.add("a", "INFO", f"{name}_warmup", seconds=time.perf_counter() - t0)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    for step in range(2):
        cap.check(f"timed {name} PPO step {step + 1}")
        sync(ctx.device)
        t0 = time.perf_counter()
        stats = update(trajectories, generator)
        sync(ctx.device)
        seconds = time.perf_counter() - t0
        tokens = stats.get("trained_tokens") or sum(len(t) for t in trajectories)
        flops = stats.get("model_flops") or palm_flops(model, trajectories)
        mfu = flops / seconds / (peak * 1e12)
        r.check(
            "a",
            f"{name}_ppo_step_{step + 1}",
            mfu >= s.min_mfu and mfu > 0 and math.isfinite(stats.get("loss", 0.0)),
            tokens_per_s=tokens / seconds,
            mfu=mfu,
            target_mfu=s.min_mfu,
            seconds=seconds,
            tokens=tokens,
            model_flops=flops,
            flops_from="update stats" if stats.get("model_flops") else "palm_flops here",
            trainer_peak_flops=stats.get("peak_flops"),
            loss=stats.get("loss"),
            gpu_memory_peak_gib=torch.cuda.max_memory_allocated() / 2**30 if ctx.device.type == "cuda" else None,
        )


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether FSDP2 (`fully_shard`) wraps any of ``model``'s modules."""
    try:
        from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def part_b(ctx, cap) -> None:
    """HFEngine (opened as a run opens it) at each concurrency, against ``model.generate`` one request at a time."""
    r, s = ctx.report, ctx.sizes
    path = model_dir(ctx)
    tokenizer = load_tokenizer(path)
    rng = random.Random(0)
    engine, _ = open_policy_engine("policy", train_config(ctx, ctx.work / "engine", path), str(path), ctx.work)
    rates = {}
    try:
        engine_rate(engine, prompts_for(tokenizer, 8, rng), 8)  # warm-up
        for concurrency in s.concurrency:
            cap.check(f"HFEngine at {concurrency} concurrent requests")
            rates[concurrency] = engine_rate(engine, prompts_for(tokenizer, concurrency, rng), s.new_tokens)
            r.add("b", "INFO", f"hf_engine_{concurrency}", tokens_per_s=rates[concurrency], new_tokens=s.new_tokens)
    finally:
        engine.close()
    cap.check("the model.generate baseline")
    dtype = "bfloat16" if ctx.device.type == "cuda" else "float32"
    model = load_model(path, dtype).to(ctx.device).eval()
    baseline = generate_rate(model, prompts_for(tokenizer, s.baseline_requests, rng), s.new_tokens, tokenizer, cap)
    one_at_a_time = max(baseline["generate_tokens_per_s"], 1e-9)
    r.check(
        "b",
        "engine_vs_generate",
        rates.get(max(s.concurrency), 0.0) > one_at_a_time,
        **{f"hf_engine_{c}": v for c, v in rates.items()},
        **baseline,
        **{f"speedup_{c}": v / one_at_a_time for c, v in rates.items()},
    )


@torch.inference_mode()
def generate_rate(model, prompts: list[list[int]], new_tokens: int, tokenizer, cap) -> dict[str, Any]:
    """``model.generate`` on each prompt in turn (sampled, exactly ``new_tokens``); stops early at the cap."""
    start, tokens, done = time.perf_counter(), 0, 0
    for p in prompts:
        if cap.left() <= 0:
            break
        out = model.generate(
            torch.tensor([p], device=model.device),
            do_sample=True,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
        tokens, done = tokens + out.shape[1] - len(p), done + 1
    return {"generate_tokens_per_s": tokens / (time.perf_counter() - start), "generate_requests": done}


def part_c(ctx, cap) -> None:
    """examples/gpu: a quick SFT, then RL steps (colocated, in_process weights); does accuracy rise? The slope of
    each step's accuracy on fresh problems, with a 95% interval (bench/gpu_check_stats.py): PASS above 0,
    FAIL below, SKIP when the interval holds 0; the held-out evaluations before and after are reported."""
    r, s = ctx.report, ctx.sizes
    if ctx.device.type == "cuda" and not device_keys(SFTConfig):  # fail in a second, not past the cap
        r.add("c", "FAIL", "sft_on_gpu", error="SFTConfig has no device key: the SFT warm start would run on the CPU")
        return
    base = ctx.work / "recipe"
    model = save_tiny_model(base / "model", preset=s.recipe_preset, overwrite=True)
    data = base / "sft_data.jsonl"
    maker = ROOT / "examples" / "arithmetic" / "make_sft_data.py"
    subprocess.run([sys.executable, str(maker), str(data), "--n", "20000"], check=True, stdout=subprocess.DEVNULL)
    evals = f"eval.num_problems={s.eval_problems}"
    sft_overrides = [f"run_dir={base / 'sft'}", f"data={data}", f"model.path={model}", f"steps={s.sft_steps}", evals]
    sft_overrides.append(f"device={ctx.device.type}")  # the recipe's cuda; the rehearsal's cpu
    sft_cfg = load_config(SFTConfig, RECIPE / "sft.yaml", sft_overrides + list(s.sft_overrides))
    sft = run_sft(sft_cfg, progress=False)
    r.add(
        "c",
        "INFO",
        "sft",
        accuracy_before=sft["accuracy_before"],
        accuracy_after=sft["accuracy_after"],
        seconds=sft["wall_seconds"],
        steps=s.sft_steps,
    )
    cap.check("RL")
    minutes = max(cap.left() - 35.0, 10.0) / 60  # leave the last evaluation and the checkpoint their time
    cpu = ("ppo.compute_dtype=auto",) if ctx.device.type == "cpu" else ()  # bf16 on a CPU: correct, but slow
    rl_cfg = train_config(
        ctx,
        base / "rl",
        sft["model"],
        f"steps={s.rl_steps}",
        f"max_train_minutes={minutes:.3f}",
        evals,
        *s.rl_overrides,
        *cpu,
    )
    rl = run_train(rl_cfg, progress=False)
    held_out = {
        "accuracy_before": rl["accuracy_before"],
        "accuracy_after": rl["accuracy_after"],
        "eval_problems": rl["eval_problems"],
        "rl_steps": rl["steps"],
        "rl_seconds": rl["wall_seconds"],
        "generated_tokens_per_s": rl["generated_tokens_per_s"],
    }
    steps, accuracy = step_scalars(base / "rl")
    if len(steps) < MIN_STEPS:
        r.add("c", "SKIP", "accuracy_slope", reason=f"{len(steps)} RL steps logged, {MIN_STEPS} needed", **held_out)
        return
    fit = slope_interval(steps, accuracy)
    if verdict(fit) == "inconclusive":
        reason = "the 95% interval of the slope holds 0: more steps (a longer cap) would decide"
        r.add("c", "SKIP", "accuracy_slope", reason=reason, **fit, **held_out)
    else:
        r.check("c", "accuracy_slope", verdict(fit) == "rises", verdict=verdict(fit), **fit, **held_out)


def device_keys(cls: type, prefix: str = "") -> list[str]:
    """The config keys named ``device`` in the dataclass ``cls`` and its sections."""
    keys = []
    for f in dataclasses.fields(cls):
        kind = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(kind):
            keys += device_keys(kind, f"{prefix}{f.name}.")
        elif f.name == "device":
            keys.append(prefix + f.name)
    return keys


def timed_pushes(ctx, policy, repeats: int, cap, what: str) -> list[float]:
    """Seconds of each of ``repeats`` weight pushes (the sync's own figure when it keeps one)."""
    times = []
    for i in range(repeats):
        cap.check(f"{what} push {i + 1}")
        sync(ctx.device)
        t0 = time.perf_counter()
        ctx.loop.run_until_complete(policy.push_weights())
        sync(ctx.device)
        times.append(time.perf_counter() - t0)
    return times


def part_d(ctx, cap) -> None:
    """Weight sync seconds of the 0.44B model: in_process (the hf engine) against disk (a serve-model server)."""
    r, s = ctx.report, ctx.sizes
    policy = policy_for(ctx)
    inproc = timed_pushes(ctx, policy, s.sync_repeats, cap, "in_process")
    best = min(inproc)
    r.check(
        "d",
        "in_process",
        best <= s.max_in_process_sync_s,
        seconds=best,
        target_s=s.max_in_process_sync_s,
        all_seconds=inproc,
        weight_sync=type(policy.weight_sync).__name__,
        last_push=getattr(policy.weight_sync, "last_push", None),
    )
    cap.check("the disk transport (a serve-model server)")
    path = model_dir(ctx)
    cfg = train_config(ctx, ctx.work / "disk", path, "engine.backend=serve-model", "engine.weight_sync=disk")
    disk_policy = open_policy("policy", cfg, str(path), str(path), ctx.work / "disk")
    try:
        disk = timed_pushes(ctx, disk_policy, max(1, s.sync_repeats - 1), cap, "disk")
    finally:
        close_policy(ctx, disk_policy)
    r.check(
        "d",
        "disk",
        all(math.isfinite(t) and t > 0 for t in disk),
        seconds=min(disk),
        all_seconds=disk,
        in_process_speedup=min(disk) / max(best, 1e-9),
        weight_sync=type(disk_policy.weight_sync).__name__,
        last_push=getattr(disk_policy.weight_sync, "last_push", None),
    )


def part_e(ctx, cap) -> None:
    """``mismatch_kl`` of an update on the engine's own samples at the trainer's current weights."""
    r = ctx.report
    policy = policy_for(ctx)
    ctx.loop.run_until_complete(policy.push_weights())  # the engine serves exactly the trainer's weights
    tokenizer = load_tokenizer(model_dir(ctx))
    prompts = prompts_for(tokenizer, 64, random.Random(1))
    sampling = SamplingParams(32, temperature=1.0, ignore_eos=True)

    async def generate() -> list:
        engine = policy.engine
        return await asyncio.gather(
            *(engine.agenerate(GenRequest(f"e{i}", p, sampling)) for i, p in enumerate(prompts))
        )

    responses = ctx.loop.run_until_complete(generate())
    trajectories = [
        Trajectory(
            input_ids=p + resp.output_tokens,
            loss_mask=[0] * len(p) + [1] * len(resp.output_tokens),
            logprobs=[0.0] * len(p) + list(resp.output_logprobs),
            versions=[-1] * len(p) + list(resp.output_versions),
            reward=float(i % 2),
            group_id=f"g{i // 8}",
        )
        for i, (p, resp) in enumerate(zip(prompts, responses))
    ]
    cap.check("the update")
    stats = ctx.loop.run_until_complete(policy.update(trajectories, torch.Generator().manual_seed(0)))
    kl, max_abs = stats.get("mismatch_kl"), stats.get("mismatch_max_abs")
    versions = sorted({v for resp in responses for v in resp.output_versions})
    r.check(
        "e",
        "mismatch_kl",
        kl is not None and math.isfinite(kl) and kl < 0.05 and stats.get("mismatch_tokens", 0) > 0,
        mismatch_kl=kl,
        mismatch_max_abs=max_abs,
        mismatch_tokens=stats.get("mismatch_tokens"),  # those sampled at the trainer's weights: all, here
        limit=0.05,
        engine_versions=versions,
        tokens=sum(len(resp.output_tokens) for resp in responses),
        stats_keys=sorted(k for k in stats if "mismatch" in k),
    )


def finish(ctx) -> None:
    """Close the shared trainer and its engine if a part left them open (forgotten first: a close that fails
    leaves no half-closed trainer for the next part)."""
    policy, ctx.policy = ctx.policy, None
    if policy is not None:
        close_policy(ctx, policy)


def part_t(ctx, cap) -> None:
    """serve-tinker on the GPU: in a module of its own (bench/gpu_check_tinker.py), which imports this one."""
    from gpu_check_tinker import part_t as tinker_part  # noqa: PLC0415

    tinker_part(ctx, cap)


PART = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e, "t": part_t}
