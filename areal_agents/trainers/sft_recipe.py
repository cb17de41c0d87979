"""`areal-agents sft`: supervised fine-tuning on chat JSONL, the warm start before RL.

Writes the fine-tuned model to ``run_dir/model`` (use it as ``model.path`` for ``train``) and reports
held-out greedy accuracy on the configured env before and after. Rows may carry tool calls, tool results and
the ``tools`` the template lists: each conversation is rendered through the model's own chat template (with
``chat_template_kwargs``), split into segments where the template rewrites history, as RL would see it.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import torch

from areal_agents.agents.chat_agent import ChatAgent
from areal_agents.config import SFTConfig
from areal_agents.config.placement import team_threads
from areal_agents.data.jsonl import SFTExample, read_sft_jsonl
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.errors import ArealAgentsError
from areal_agents.models.device import compute_dtype, resolve_device
from areal_agents.models.loading import check_max_new_tokens, load_model, load_tokenizer, pad_token_id
from areal_agents.progress import plural, progress_bar
from areal_agents.rollout.held_out import evaluate
from areal_agents.trainers.checkpoint import save_model
from areal_agents.trainers.metrics_writer import MetricsWriter, prefixed
from areal_agents.trainers.optim import make_optimizer
from areal_agents.trainers.run_start import held_out_seeds, open_checked_backend, prepare_run_dir, seed_everything
from areal_agents.trainers.sft import conversation_to_segments, sft_update
from areal_agents.types import SamplingParams, Trajectory


def run_sft(cfg: SFTConfig, progress: bool = True) -> dict[str, Any]:
    """Fine-tune as configured; return the summary also written to ``run_dir/summary.json``."""
    if not cfg.data:
        from areal_agents.errors import ConfigError

        raise ConfigError("config key 'data' is empty: set it to a chat JSONL file")
    conversations = read_sft_jsonl(cfg.data)
    evaluating = cfg.eval.num_problems > 0
    if evaluating:  # the held-out episodes generate up to max_new_tokens a turn
        check_max_new_tokens(cfg.max_new_tokens, cfg.model.path, "max_new_tokens")
    loop = asyncio.new_event_loop()  # one loop for every evaluation (the env backend is bound to it)
    backend = loop.run_until_complete(open_checked_backend(cfg.env, cfg.eval)) if evaluating else None
    try:
        return _sft(cfg, conversations, backend, loop, progress)
    finally:
        if backend is not None:
            loop.run_until_complete(backend.aclose())
        loop.close()


def _sft(cfg, conversations, backend, loop, progress):
    evaluating = backend is not None
    tokenizer = load_tokenizer(cfg.model.path)
    device = resolve_device(cfg.device)
    model = load_model(cfg.model.path, cfg.model.dtype).to(device)
    if device.type == "cpu":  # the cores less the event loop's: a team wider than its cores waits on a busy one
        torch.set_num_threads(team_threads())
    run_dir = prepare_run_dir(cfg.run_dir, cfg)
    seed_everything(cfg.seed)
    data = [s for example in conversations for s in _segments(example, tokenizer, cfg.chat_template_kwargs)]
    pad = pad_token_id(tokenizer)

    engine = None
    if evaluating:  # its own copy on the same device, refreshed from the trained weights before each eval
        engine = HFEngine(load_model(cfg.model.path, cfg.model.dtype), seed=cfg.seed, device=str(device.type))
    sampling = SamplingParams(cfg.max_new_tokens, temperature=0.0)
    greedy = ChatAgent(engine, tokenizer, sampling, chat_template_kwargs=cfg.chat_template_kwargs) if engine else None
    seeds = loop.run_until_complete(held_out_seeds(backend, cfg.eval)) if evaluating else []
    metrics = MetricsWriter(run_dir / "tensorboard")

    def run_eval(step: int) -> dict[str, float] | None:
        if engine is None:
            return None
        loop.run_until_complete(engine.update_weights(model.state_dict()))
        result = loop.run_until_complete(evaluate(greedy, lambda: backend.make(**cfg.eval.env_kwargs), seeds))
        metrics.log(step, prefixed("eval", result))
        return result

    start = time.perf_counter()
    before = run_eval(0)
    if before:
        print(f"held-out greedy accuracy before SFT: {before['accuracy']:.1%} ({plural(len(seeds), 'problem')})")
    optimizer, scheduler = make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.warmup_steps)
    generator = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []
    bar = progress_bar(range(1, cfg.steps + 1), desc="sft", enabled=progress)
    trained_tokens = 0
    for step in bar:
        if len(order) < cfg.batch_size:  # reshuffle each epoch
            order += torch.randperm(len(data), generator=generator).tolist()
        batch, order = [data[i] for i in order[: cfg.batch_size]], order[cfg.batch_size :]
        t0 = time.perf_counter()
        stats = sft_update(
            model,
            optimizer,
            scheduler,
            batch,
            micro_batch_tokens=cfg.micro_batch_tokens,
            max_grad_norm=cfg.max_grad_norm,
            pad_token_id=pad,
            compute_dtype=compute_dtype(device, cfg.compute_dtype),
        )
        trained_tokens += int(stats["loss_tokens"])
        stats["tokens_per_s"] = sum(len(t) for t in batch) / max(time.perf_counter() - t0, 1e-9)
        metrics.log(step, prefixed("train", stats))
        bar.set_postfix(loss=f"{stats['loss']:.3f}", tok_s=f"{stats['tokens_per_s']:.0f}", refresh=False)
        if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.steps:
            result = run_eval(step)
            if result:
                bar.write(f"step {step}: held-out greedy accuracy {result['accuracy']:.1%}")
    bar.close()
    after = run_eval(cfg.steps)
    model_dir = save_model(run_dir / "model", model, tokenizer)
    metrics.close()
    if engine is not None:
        loop.run_until_complete(engine.aclose())
    summary = {
        "accuracy_before": before["accuracy"] if before else None,
        "accuracy_after": after["accuracy"] if after else None,
        "eval_problems": len(seeds),
        "steps": cfg.steps,
        "conversations": len(conversations),
        "segments": len(data),
        "wall_seconds": time.perf_counter() - start,
        "model": str(model_dir),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if after:
        print(f"held-out greedy accuracy after SFT: {after['accuracy']:.1%} ({plural(len(seeds), 'problem')})")
    print(f"fine-tuned model: {model_dir}")
    return summary


def _segments(example: SFTExample, tokenizer: Any, template_kwargs: dict[str, Any]) -> list[Trajectory]:
    """The example's trajectories; a conversation the template cannot render names its row."""
    try:
        return conversation_to_segments(example.messages, tokenizer, example.tools, template_kwargs)
    except ArealAgentsError as e:
        raise ArealAgentsError(f"{example.source}: {e}") from None
    except Exception as e:  # the chat template's own error (jinja2 raise_exception, a missing key)
        raise ArealAgentsError(f"{example.source}: the chat template cannot render this conversation: {e}") from None
