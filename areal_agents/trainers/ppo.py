"""Decoupled PPO on a batch of trajectories (GRPO groups, or GAE with a critic): one update path.

1. prepare: `prepare_batch` (`ppo_batch.py`): advantages, zero-variance groups dropped, π_prox (and
   the critic's values and returns) with the weights as they are.
2. accumulate: `accumulate`: forward and backward of each token-budgeted micro-batch, the loss summed
   over tokens / ``num_tokens``; gradients add up in ``.grad``.
3. step: `optim.optimizer_step` (and `critic.critic_step`): normalise, clip (the global norm), step.

Each micro-batch goes to the model's device once; an unsharded model computes under autocast to
``ppo.compute_dtype`` (nothing at all in float32, the CPU default), a sharded one casts by FSDP2's
mixed-precision policy (`fsdp.py`), where gradients are also summed across ranks, once per optimizer step
in its last micro-batch's backward (`fsdp.gradient_sync`).

`ppo_update` runs them for ``ppo_epochs`` x ``num_minibatches`` optimizer steps, each over a minibatch
whose loss-token count is known before its first micro-batch. `StreamedUpdate` is the one-step case
fed in parts (an asynchronous trainer starts on a batch's finished groups while its last are still
generating): each part is prepared and accumulated as it arrives with ``num_tokens = 1``, and the step
divides the summed gradients by the batch's loss tokens, a count known only at the end. That is the
same gradient: advantages are per group, and π_prox is the detached forward of these very weights.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from areal_agents.config import PPOConfig
from areal_agents.models.device import gpu_memory, peak_tflops, reset_peak_memory
from areal_agents.trainers.batching import ScoredLM, module_device, token_logprobs
from areal_agents.trainers.critic import ValueModel, critic_backward, critic_step, critic_values
from areal_agents.trainers.distributed import DataParallel, lm_flops
from areal_agents.trainers.fsdp import gradient_sync
from areal_agents.trainers.host_stats import to_host
from areal_agents.trainers.microbatch import MicroBatch, spread
from areal_agents.trainers.optim import optimizer_step
from areal_agents.trainers.ppo_batch import (
    PreparedBatch,
    add_counts,
    batch_stats,
    precision,
    prepare_batch,
    proximal_logprobs,
)
from areal_agents.trainers.ppo_loss import decoupled_ppo_loss, kl_to_reference, mismatch_stats, sequence_ratio_mask
from areal_agents.types import Trajectory

__all__ = ["StreamedUpdate", "critic_values", "ppo_update", "proximal_logprobs", "streamable"]

# per-micro-batch statistics, token-weighted within an optimizer step (then averaged over steps)
_MB_STATS = (
    "loss",
    "clip_fraction",
    "dual_clip_fraction",
    "capped_fraction",
    "approx_kl",
    "ratio_mean",
    "behav_weight_mean",
    "kl_ref",
)
_CRITIC_STATS = ("value_loss", "value_clip_fraction")
# train/inference mismatch sums (`ppo_loss.mismatch_stats`) and the sequence-level mask's count, over the update
_MISMATCH_SUMS = ("mismatch_kl_sum", "mismatch_tokens", "seq_masked", "loss_tokens")
# what `prepare_batch` counts with group advantages (a streamed batch sums them over its parts)
_GROUP_COUNTS = ("groups", "flat_groups", "trained", "loss_tokens", "advantage_abs_sum", "advantage_count")


def streamable(cfg: PPOConfig) -> bool:
    """Whether an update of ``cfg`` is one optimizer step on group advantages (`StreamedUpdate` can run it)."""
    return cfg.ppo_epochs * cfg.num_minibatches == 1 and cfg.advantage != "gae"


class _Tally:
    """An update's micro-batch stats: sums weighted by loss tokens, divided by each optimizer step's loss
    tokens at its end, averaged over steps; losses are kept as sums over tokens (``loss * num_tokens``)."""

    def __init__(self, critic: bool) -> None:
        keys = _MB_STATS + (_CRITIC_STATS if critic else ())
        self.step = dict.fromkeys(keys, 0.0)
        self.run = dict.fromkeys(keys, 0.0)
        self.per_step: dict[str, float] = defaultdict(float)  # grad norms: the same on every rank
        self.behav_weight_max, self.steps = 0.0, 0
        # the policy's forward + backward, for MFU (`MicroBatch.computed_tokens` and `MicroBatch.attended`)
        self.work = {"trained_tokens": 0.0, "computed_tokens": 0.0, "attended": 0.0}
        self.mismatch = dict.fromkeys(_MISMATCH_SUMS, 0.0)
        self.mismatch_max = 0.0

    def add(self, st: dict[str, float], loss_sum: float, value: tuple[float, float] | None = None) -> None:
        """One micro-batch's loss stats (and, with a critic, its value loss sum and clipped fraction)."""
        tokens = st["loss_tokens"]
        self.step["loss"] += loss_sum
        for key in _MB_STATS[1:]:
            self.step[key] += st.get(key, 0.0) * tokens
        self.behav_weight_max = max(self.behav_weight_max, st["behav_weight_max"])
        for key in _MISMATCH_SUMS:
            self.mismatch[key] += st.get(key, 0.0)
        self.mismatch_max = max(self.mismatch_max, st.get("mismatch_max_abs", 0.0))
        if value is not None:
            self.step["value_loss"] += value[0]
            self.step["value_clip_fraction"] += value[1] * tokens

    def end_step(self, loss_tokens: float, **norms: float) -> None:
        for key, value in self.step.items():
            self.run[key] += value / max(loss_tokens, 1.0)
            self.step[key] = 0.0
        for key, value in norms.items():
            self.per_step[key] += value
        self.steps += 1

    def stats(self, dp: DataParallel | None) -> dict[str, float]:
        run, bmax = (dp.sum(self.run), dp.max(self.behav_weight_max)) if dp else (self.run, self.behav_weight_max)
        out = {key: value / max(self.steps, 1) for key, value in (run | self.per_step).items()}
        return out | {"behav_weight_max": bmax, "optimizer_steps": float(self.steps)} | self.mismatch_stats(dp)

    def mismatch_stats(self, dp: DataParallel | None) -> dict[str, float]:
        """``mismatch_kl`` (per token) and ``mismatch_max_abs`` over the tokens scored at the engine's weights,
        how many there were, and the fraction of loss tokens the sequence-level mask left out."""
        sums, top = (dp.sum(self.mismatch), dp.max(self.mismatch_max)) if dp else (self.mismatch, self.mismatch_max)
        return {
            "mismatch_kl": sums["mismatch_kl_sum"] / max(sums["mismatch_tokens"], 1.0),
            "mismatch_max_abs": top,
            "mismatch_tokens": sums["mismatch_tokens"],
            "seq_masked_fraction": sums["seq_masked"] / max(sums["seq_masked"] + sums["loss_tokens"], 1.0),
        }

    def perf(self, model: torch.nn.Module, cfg: PPOConfig, dp: DataParallel | None) -> dict[str, float]:
        """``trained_tokens`` (the trajectories' tokens through the policy's forward and backward, padding
        ranks' copies left out; a shared prompt counted with each of its completions), ``computed_tokens``
        (those the model computed: a shared prompt once), ``model_flops`` (`lm_flops` of the computed tokens)
        and ``peak_flops`` summed over ranks, and on CUDA ``perf/gpu_memory_*`` (the largest rank's; the
        peak since the update started)."""
        device = module_device(model)
        peak = (peak_tflops(device, cfg.peak_tflops) or 0.0) * 1e12
        work = self.work | {"peak_flops": peak}
        work = dp.sum(work) if dp else work
        lm = model.lm if isinstance(model, ScoredLM) else model
        flops = lm_flops(lm, work["computed_tokens"], work["attended"])
        memory = gpu_memory(device)
        if dp:
            memory = {key: dp.max(value) for key, value in sorted(memory.items())}
        return {
            "trained_tokens": work["trained_tokens"],
            "computed_tokens": work["computed_tokens"],
            "model_flops": flops,
            "peak_flops": work["peak_flops"],
        } | memory


def micro_batch_loss(
    model: PreTrainedModel,
    mb: MicroBatch,
    cfg: PPOConfig,
    temperature: float,
    num_tokens: float,
    ref_model: PreTrainedModel | None,
    policy_version: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The decoupled PPO loss of one micro-batch (plus the KL penalty), summed over tokens / ``num_tokens``.
    ``mb.prox_logprobs`` None: π_prox is this forward, detached (one optimizer step per batch).

    π_prox is the trainer at the engine's current weights, so on the tokens the engine sampled with them
    (version ``policy_version``; None: every token) π_prox vs π_behav is the train/inference mismatch
    (`ppo_loss.mismatch_stats`); ``ppo.behav_seq_ratio_min/max`` leave out whole trajectories by it."""
    logp = token_logprobs(model, mb, temperature)
    prox = mb.prox_logprobs if mb.prox_logprobs is not None else logp.detach()
    mask = mb.loss_mask
    low, high = cfg.behav_seq_ratio_min, cfg.behav_seq_ratio_max
    if low is not None or high is not None:
        mask = sequence_ratio_mask(prox - mb.logprobs, mb.loss_mask, mb.slices or [], low, high)
    loss, st = decoupled_ppo_loss(
        logp,
        prox,
        mb.logprobs,
        mb.advantages,
        mask,
        eps_clip=cfg.eps_clip,
        eps_clip_higher=cfg.eps_clip_higher,
        dual_clip=cfg.dual_clip,
        behav_imp_weight_cap=cfg.behav_imp_weight_cap,
        behav_imp_weight_mode=cfg.behav_imp_weight_mode,
        num_tokens=num_tokens,
    )
    if cfg.kl_coef > 0 and ref_model is not None:
        with torch.no_grad():
            logp_ref = token_logprobs(ref_model, mb, temperature)
        penalty, st["kl_ref"] = kl_to_reference(logp, logp_ref, mask, num_tokens)
        loss = loss + cfg.kl_coef * penalty
    fresh = mb.loss_mask.bool()
    if policy_version is not None and mb.versions is not None:
        fresh = fresh & (mb.versions == policy_version)
    st |= mismatch_stats(prox, mb.logprobs, fresh) | {"seq_masked": (mb.loss_mask - mask).sum()}
    return loss, st


def accumulate(
    model: PreTrainedModel,
    mbs: list[MicroBatch],
    batch: PreparedBatch,
    cfg: PPOConfig,
    tally: _Tally,
    *,
    temperature: float,
    num_tokens: float,
    ref_model: PreTrainedModel | None = None,
    critic: ValueModel | None = None,
    policy_version: int | None = None,
) -> None:
    """Forward and backward of each micro-batch of ``batch`` (its trajectories indexed like ``batch``'s):
    the policy's loss and, with ``critic``, the value loss, each summed over tokens / ``num_tokens``.

    The micro-batches' stats stay on the device until the last backward, then come to the host in one
    transfer (`host_stats.to_host`). Sharded models reduce-scatter their gradients once, in the last
    micro-batch's backward (`gradient_sync`)."""
    device, context = module_device(model), precision(model, cfg)
    rows: list[dict[str, torch.Tensor]] = []
    for i, mb in enumerate(mbs):  # a rank's padding (`DataParallel.share`) runs as the others do, with no loss tokens
        mb.advantages = spread(mb, batch.advantages)
        mb = mb.to(device)
        with gradient_sync([model, critic], i == len(mbs) - 1):
            with context():
                loss, st = micro_batch_loss(model, mb, cfg, temperature, num_tokens, ref_model, policy_version)
            loss.backward()
            st["loss"] = loss.detach()
            if critic is not None:
                st["value_loss"], st["value_clip_fraction"] = critic_backward(
                    critic, mb, batch.old_values, batch.returns, cfg.value_clip, num_tokens, context
                )
        rows.append(st)
        # its trajectories' tokens, whatever the layout (a streamed batch counts what the whole would)
        tally.work["trained_tokens"] += sum(b - a for _, a, b in mb.slices)
        tally.work["computed_tokens"] += mb.computed_tokens
        tally.work["attended"] += mb.attended
    for st in to_host(rows):
        value = (st["value_loss"] * num_tokens, st["value_clip_fraction"]) if critic is not None else None
        tally.add(st, st["loss"] * num_tokens, value)


def _minibatches(n: int, cfg: PPOConfig, generator: torch.Generator | None) -> Iterator[list[int]]:
    """``ppo_epochs`` shuffles of ``range(n)``, each cut into ``num_minibatches`` (non-empty) index lists."""
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(n, generator=generator).tolist()
        for chunk in torch.tensor_split(torch.tensor(order), cfg.num_minibatches):
            if len(chunk):
                yield chunk.tolist()


def ppo_update(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    trajectories: list[Trajectory],
    cfg: PPOConfig,
    *,
    temperature: float,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    ref_model: PreTrainedModel | None = None,
    critic: ValueModel | None = None,
    critic_optimizer: torch.optim.Optimizer | None = None,
    dp: DataParallel | None = None,
    max_new_tokens: int | None = None,
    policy_version: int | None = None,
) -> dict[str, float]:
    """Train on one batch; return namespaced-ready stats (loss, clip fraction, weights, grad norm).

    With ``cfg.kl_coef > 0``, ``ref_model`` (frozen, usually the initial policy) adds a KL penalty.
    ``cfg.advantage == "gae"`` needs ``critic`` and ``critic_optimizer``. With ``dp`` this rank trains
    on its share of every minibatch and gradients are summed across ranks (`distributed.py`).
    ``max_new_tokens``: the rollout's, which ``cfg.overlong_buffer`` needs (`prepare_batch`).
    ``policy_version``: the engine's version of these weights, whose tokens measure the mismatch."""
    reset_peak_memory(module_device(model))  # perf/gpu_memory_peak_gib: this update's peak
    use_gae = cfg.advantage == "gae"
    if use_gae and (critic is None or critic_optimizer is None):
        raise ValueError("ppo.advantage=gae needs a critic and its optimizer")
    critic = critic if use_gae else None
    batch = prepare_batch(
        model,
        trajectories,
        cfg,
        temperature=temperature,
        pad_token_id=pad_token_id,
        critic=critic,
        dp=dp,
        max_new_tokens=max_new_tokens,
    )
    stats = batch_stats(batch.counts)
    if not batch.trajectories:
        return stats | {"skipped": 1.0}
    tally = _Tally(critic is not None)
    for idx in _minibatches(len(batch.trajectories), cfg, generator):
        minibatch = batch.select(idx)
        mbs = minibatch.micro_batches(cfg, pad_token_id)
        total = sum(mb.num_loss_tokens for mb in mbs)  # over every rank's share
        optimizer.zero_grad(set_to_none=True)
        if critic is not None:
            critic_optimizer.zero_grad(set_to_none=True)
        accumulate(
            model, dp.share(mbs) if dp else mbs, minibatch, cfg, tally,
            temperature=temperature, num_tokens=total, ref_model=ref_model, critic=critic,
            policy_version=policy_version,
        )  # fmt: skip
        norms = {"grad_norm": optimizer_step(model, optimizer, cfg.max_grad_norm, scheduler=scheduler)}
        if critic is not None:
            norms["critic_grad_norm"] = critic_step(critic, critic_optimizer, cfg.max_grad_norm)
        tally.end_step(total, **norms)
    stats |= tally.stats(dp) | tally.perf(model, cfg, dp)
    return stats | {"lr": scheduler.get_last_lr()[0], "loss_tokens": batch.counts["loss_tokens"]}


class StreamedUpdate:
    """One PPO optimizer step on a batch that arrives in parts of whole groups.

    `add` prepares a part and runs its forward and backward at once, its loss summed over tokens (not yet
    normalised); `finish` divides the gradients by the batch's loss tokens, clips and steps. The result
    is `ppo_update`'s on the whole batch.

        update = StreamedUpdate(model, optimizer, scheduler, PPOConfig(), temperature=1.0, pad_token_id=0)
        for part in finished_groups:  # lists of trajectories, every member of each group
            update.add(part)
        stats = update.finish(generator)
    """

    def __init__(
        self,
        model: PreTrainedModel,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        cfg: PPOConfig,
        *,
        temperature: float,
        pad_token_id: int,
        ref_model: PreTrainedModel | None = None,
        max_new_tokens: int | None = None,
        policy_version: int | None = None,
    ) -> None:
        if not streamable(cfg):
            raise ValueError(
                "StreamedUpdate: expects ppo_epochs * num_minibatches == 1 and group advantages, got "
                f"ppo_epochs={cfg.ppo_epochs}, num_minibatches={cfg.num_minibatches}, advantage={cfg.advantage!r}"
            )
        self.model, self.optimizer, self.scheduler, self.cfg = model, optimizer, scheduler, cfg
        self.temperature, self.pad_token_id, self.ref_model = temperature, pad_token_id, ref_model
        self.max_new_tokens, self.policy_version = max_new_tokens, policy_version
        self.counts = dict.fromkeys(_GROUP_COUNTS, 0.0)
        self.tally = _Tally(critic=False)
        reset_peak_memory(module_device(model))  # perf/gpu_memory_peak_gib: this update's peak
        optimizer.zero_grad(set_to_none=True)

    def add(self, trajectories: list[Trajectory]) -> None:
        """Forward and backward on whole groups (every trajectory of each group id among them)."""
        part = prepare_batch(
            self.model,
            trajectories,
            self.cfg,
            temperature=self.temperature,
            pad_token_id=self.pad_token_id,
            max_new_tokens=self.max_new_tokens,
        )
        add_counts(self.counts, part.counts)
        mbs = part.micro_batches(self.cfg, self.pad_token_id) if part.trajectories else []
        accumulate(
            self.model, mbs, part, self.cfg, self.tally,
            temperature=self.temperature, num_tokens=1.0, ref_model=self.ref_model,
            policy_version=self.policy_version,
        )  # fmt: skip

    def finish(self, generator: torch.Generator | None = None) -> dict[str, float]:
        """Normalise, clip and step (unless no part had a trajectory to train); the step's stats."""
        stats = batch_stats(self.counts)
        trained = int(self.counts["trained"])
        if not trained:
            return stats | {"skipped": 1.0}
        # the draw of ppo_update's one minibatch: the generator's stream is that of an unstreamed update
        torch.randperm(trained, generator=generator)
        total = max(self.counts["loss_tokens"], 1.0)
        grad_norm = optimizer_step(
            self.model, self.optimizer, self.cfg.max_grad_norm, scheduler=self.scheduler, grad_divisor=total
        )
        self.tally.end_step(total, grad_norm=grad_norm)
        stats |= self.tally.stats(None) | self.tally.perf(self.model, self.cfg, None)
        return stats | {"lr": self.scheduler.get_last_lr()[0], "loss_tokens": self.counts["loss_tokens"]}
