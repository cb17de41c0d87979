"""One decoupled-PPO training step on a batch of trajectories (GRPO groups, or GAE with a critic).

Steps, in order: group advantages -> drop zero-variance groups -> proximal logprobs with the current
weights (and, for GAE, the critic's values -> per-token advantages and returns) -> ``ppo_epochs`` x
``num_minibatches`` optimizer steps, each accumulating gradients over token-budgeted micro-batches with
the loss normalised by the minibatch's loss tokens; the critic steps beside the policy.

`StreamedUpdate` is the one-optimizer-step case (the default: one epoch, one minibatch, group
advantages) fed in parts: a part's forward and backward run as it arrives, so an asynchronous trainer
starts on a batch's finished groups while its last are still generating. `ppo_update` takes that path
for such batches too (the whole batch as one part).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from transformers import PreTrainedModel

from areal_agents.config import PPOConfig
from areal_agents.trainers.advantages import group_advantages, shape_rewards, zero_variance_groups
from areal_agents.trainers.batching import MicroBatch, make_micro_batches, spread, token_logprobs
from areal_agents.trainers.critic import ValueModel, gae, value_loss, whiten
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.ppo_loss import decoupled_ppo_loss, kl_to_reference
from areal_agents.types import Trajectory

# per-micro-batch statistics, summed weighted by loss tokens (then averaged over optimizer steps)
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


@torch.no_grad()
def proximal_logprobs(
    model: PreTrainedModel,
    trajectories: list[Trajectory],
    temperature: float,
    max_tokens: int,
    pad: int,
    pack: bool = False,
    dp: DataParallel | None = None,
    share_prompts: bool = False,
) -> list[torch.Tensor]:
    """π_prox logprobs of every token of every trajectory, with the weights as they are now."""

    def score(mb: MicroBatch) -> torch.Tensor:
        return token_logprobs(model, mb, temperature)

    return _per_token(score, trajectories, max_tokens, pad, pack, dp, share_prompts)


@torch.no_grad()
def critic_values(
    critic: ValueModel,
    trajectories: list[Trajectory],
    max_tokens: int,
    pad: int,
    pack: bool = False,
    dp: DataParallel | None = None,
    share_prompts: bool = False,
) -> list[torch.Tensor]:
    """The critic's value of the prefix before every token of every trajectory."""
    return _per_token(critic, trajectories, max_tokens, pad, pack, dp, share_prompts)


def _per_token(score, trajectories, max_tokens, pad, pack, dp, share_prompts) -> list[torch.Tensor]:
    """``score(micro_batch)`` cut back into one tensor per trajectory (each rank scores its share)."""
    mbs = make_micro_batches(trajectories, max_tokens, pad_token_id=pad, pack=pack, share_prompts=share_prompts)
    out: dict[int, torch.Tensor] = {}
    for mb in dp.share(mbs) if dp else mbs:
        values = score(mb)
        for (row, a, b), i in zip(mb.slices, mb.index):
            out[i] = values[row, a:b].clone()
    if dp:
        out = dp.gather(out)
    return [out[i] for i in range(len(trajectories))]


def streamable(cfg: PPOConfig) -> bool:
    """Whether an update of ``cfg`` is one optimizer step on group advantages (`StreamedUpdate` can run it)."""
    return cfg.ppo_epochs * cfg.num_minibatches == 1 and cfg.advantage != "gae"


class StreamedUpdate:
    """One PPO optimizer step on a batch that arrives in parts of whole groups.

    `add` runs a part's forward and backward at once, its loss summed over tokens (not yet normalised);
    `finish` divides the gradients by the batch's loss tokens, clips and steps. That is the gradient of
    one step on the whole batch: advantages are per group, π_prox is the detached forward of these very
    weights, and the token-mean loss is a sum divided by a count known only at the end.
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
    ) -> None:
        if not streamable(cfg):
            raise ValueError(
                "StreamedUpdate: expects ppo_epochs * num_minibatches == 1 and group advantages, got "
                f"ppo_epochs={cfg.ppo_epochs}, num_minibatches={cfg.num_minibatches}, advantage={cfg.advantage!r}"
            )
        self.model, self.optimizer, self.scheduler, self.cfg = model, optimizer, scheduler, cfg
        self.temperature, self.pad_token_id, self.ref_model = temperature, pad_token_id, ref_model
        self.sums: dict[str, float] = dict.fromkeys(_MB_STATS, 0.0)  # token-weighted, divided in `finish`
        self.counts: dict[str, float] = defaultdict(float)
        self.behav_weight_max = 0.0
        optimizer.zero_grad(set_to_none=True)

    def add(self, trajectories: list[Trajectory]) -> None:
        """Forward and backward on whole groups (every trajectory of each group id among them)."""
        keep, group_adv, counts = _group_advantages(trajectories, self.cfg)
        for key, value in counts.items():
            self.counts[key] += value
        if not keep:
            return
        trajs = [trajectories[i] for i in keep]
        self.counts["loss_tokens"] += float(sum(sum(t.loss_mask) for t in trajs))
        masks = [torch.tensor(t.loss_mask, dtype=torch.float) for t in trajs]
        adv = [a * m for a, m in zip(group_adv, masks)]
        self.model.train()
        cfg = self.cfg
        mbs = make_micro_batches(
            trajs,
            cfg.micro_batch_tokens,
            pad_token_id=self.pad_token_id,
            pack=cfg.packing,
            share_prompts=cfg.share_prompts,
        )
        for mb in mbs:
            mb.advantages = spread(mb, adv)
            loss, st = _micro_batch_loss(self.model, mb, None, cfg, self.temperature, 1.0, self.ref_model)
            loss.backward()
            self.behav_weight_max = _add_stats(self.sums, loss, st, st["loss_tokens"], self.behav_weight_max)

    def finish(self, generator: torch.Generator | None = None) -> dict[str, float]:
        """Normalise, clip and step (unless no part had a trajectory to train); the step's stats."""
        c = self.counts
        stats = {
            "zero_variance_group_fraction": c["flat_groups"] / max(c["groups"], 1.0),
            "advantage_abs_mean": c["advantage_abs_sum"] / max(c["trajectories"], 1.0),
            "trained_trajectories": c["trained"],
        }
        if not c["trained"]:
            stats["skipped"] = 1.0
            return stats
        # the draw of ppo_update's one minibatch: the generator's stream is that of an unstreamed update
        torch.randperm(int(c["trained"]), generator=generator)
        total = max(c["loss_tokens"], 1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(total)
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        stats |= {key: value / total for key, value in self.sums.items()}
        stats["behav_weight_max"] = self.behav_weight_max
        stats["optimizer_steps"] = 1.0
        stats["lr"] = self.scheduler.get_last_lr()[0]
        stats["loss_tokens"] = c["loss_tokens"]
        return stats


def _group_advantages(
    trajectories: list[Trajectory], cfg: PPOConfig
) -> tuple[list[int], list[float], dict[str, float]]:
    """The trajectories to train (zero-variance groups filtered), their group advantages, and counts for stats."""
    rewards = shape_rewards([t.reward for t in trajectories], cfg.reward_scale, cfg.reward_bias, cfg.reward_clip)
    # GRPO groups are (prompt, agent role): in a multi-agent episode each role is compared with itself
    group_ids = [f"{t.group_id}/{t.agent_id}" for t in trajectories]
    flat = zero_variance_groups(rewards, group_ids)
    episode_ids = [t.episode_id or f"#{i}" for i, t in enumerate(trajectories)]
    advantages = group_advantages(rewards, group_ids, cfg.advantage, episode_ids=episode_ids)
    keep = [i for i, g in enumerate(group_ids) if not (cfg.filter_zero_variance_groups and g in flat)]
    counts = {
        "groups": float(len(set(group_ids))),
        "flat_groups": float(len(flat)),
        "trajectories": float(len(trajectories)),
        "advantage_abs_sum": float(advantages.abs().sum()),
        "trained": float(len(keep)),
    }
    return keep, advantages[keep].tolist(), counts


def _micro_batch_loss(
    model: PreTrainedModel,
    mb: MicroBatch,
    prox: torch.Tensor | None,
    cfg: PPOConfig,
    temperature: float,
    total: float,
    ref_model: PreTrainedModel | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The decoupled PPO loss of one micro-batch (plus the KL penalty), summed over tokens / ``total``.
    ``prox`` None: π_prox is this forward, detached (one optimizer step per batch)."""
    logp = token_logprobs(model, mb, temperature)
    loss, st = decoupled_ppo_loss(
        logp,
        prox if prox is not None else logp.detach(),
        mb.logprobs,
        mb.advantages,
        mb.loss_mask,
        eps_clip=cfg.eps_clip,
        eps_clip_higher=cfg.eps_clip_higher,
        dual_clip=cfg.dual_clip,
        behav_imp_weight_cap=cfg.behav_imp_weight_cap,
        behav_imp_weight_mode=cfg.behav_imp_weight_mode,
        num_tokens=total,
    )
    if cfg.kl_coef > 0 and ref_model is not None:
        with torch.no_grad():
            logp_ref = token_logprobs(ref_model, mb, temperature)
        penalty, st["kl_ref"] = kl_to_reference(logp, logp_ref, mb.loss_mask, total)
        loss = loss + cfg.kl_coef * penalty
    return loss, st


def _add_stats(
    sums: dict[str, float], loss: torch.Tensor, st: dict[str, float], weight: float, seen_max: float
) -> float:
    """Add a micro-batch's loss and its per-token stats (times ``weight``) to ``sums``; the max behavior weight."""
    sums["loss"] += float(loss.detach())
    for key in _MB_STATS[1:]:
        sums[key] += st.get(key, 0.0) * weight
    return max(seen_max, st["behav_weight_max"])


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
) -> dict[str, float]:
    """Train on one batch; return namespaced-ready stats (loss, clip fraction, weights, grad norm).

    With ``cfg.kl_coef > 0``, ``ref_model`` (frozen, usually the initial policy) adds a KL penalty.
    ``cfg.advantage == "gae"`` needs ``critic`` and ``critic_optimizer``. With ``dp`` this rank trains
    on its share of every minibatch and gradients are summed across ranks (`distributed.py`)."""
    use_gae = cfg.advantage == "gae"
    if use_gae and (critic is None or critic_optimizer is None):
        raise ValueError("ppo.advantage=gae needs a critic and its optimizer")
    if streamable(cfg) and dp is None:  # one optimizer step: the whole batch as one part
        update = StreamedUpdate(
            model, optimizer, scheduler, cfg, temperature=temperature, pad_token_id=pad_token_id, ref_model=ref_model
        )
        update.add(trajectories)
        return update.finish(generator)
    rewards = shape_rewards([t.reward for t in trajectories], cfg.reward_scale, cfg.reward_bias, cfg.reward_clip)
    if use_gae:  # the critic is the baseline: every trajectory carries signal
        group_ids = [f"{t.group_id}/{t.agent_id}" for t in trajectories]
        stats = {
            "zero_variance_group_fraction": len(zero_variance_groups(rewards, group_ids)) / max(len(set(group_ids)), 1)
        }
        keep, group_adv = list(range(len(trajectories))), []
    else:
        keep, group_adv, counts = _group_advantages(trajectories, cfg)
        stats = {
            "zero_variance_group_fraction": counts["flat_groups"] / max(counts["groups"], 1.0),
            "advantage_abs_mean": counts["advantage_abs_sum"] / max(counts["trajectories"], 1.0),
        }
    stats["trained_trajectories"] = float(len(keep))
    if not keep:
        stats["skipped"] = 1.0
        return stats
    trajs = [trajectories[i] for i in keep]
    masks = [torch.tensor(t.loss_mask, dtype=torch.float) for t in trajs]

    model.train()
    # With one optimizer step per batch, π_prox is the weights of that step's own forward pass: its
    # logprobs are the detached forward, exactly, so the extra no-grad pass is skipped.
    one_step = cfg.ppo_epochs * cfg.num_minibatches == 1
    prox = (
        None
        if one_step
        else proximal_logprobs(
            model, trajs, temperature, cfg.micro_batch_tokens, pad_token_id, cfg.packing, dp, cfg.share_prompts
        )
    )
    if use_gae:
        critic.train()
        old_values = critic_values(
            critic, trajs, cfg.micro_batch_tokens, pad_token_id, cfg.packing, dp, cfg.share_prompts
        )
        adv_returns = [gae(v, m, rewards[i], cfg.gamma, cfg.lam) for v, m, i in zip(old_values, masks, keep)]
        adv = [a for a, _ in adv_returns]
        returns = [r for _, r in adv_returns]
        if cfg.whiten_advantages:
            adv = whiten(adv, masks)
        n_tokens = max(float(sum(m.sum() for m in masks)), 1.0)
        stats["value_mean"] = float(sum((v * m).sum() for v, m in zip(old_values, masks))) / n_tokens
        stats["return_mean"] = float(sum(r.sum() for r in returns)) / n_tokens
        stats["advantage_abs_mean"] = float(sum((a.abs() * m).sum() for a, m in zip(adv, masks))) / n_tokens
    else:
        adv = [a * m for a, m in zip(group_adv, masks)]
    sums: dict[str, float] = dict.fromkeys(_MB_STATS + (("value_loss", "value_clip_fraction") if use_gae else ()), 0.0)
    step_sums: dict[str, float] = defaultdict(float)  # once per optimizer step (the same on every rank)
    behav_weight_max, steps = 0.0, 0
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(len(trajs), generator=generator).tolist()
        for chunk in torch.tensor_split(torch.tensor(order), cfg.num_minibatches):
            idx = chunk.tolist()
            if not idx:
                continue
            mbs = make_micro_batches(
                [trajs[i] for i in idx],
                cfg.micro_batch_tokens,
                pad_token_id=pad_token_id,
                prox_logprobs=[prox[i] for i in idx] if prox is not None else None,
                pack=cfg.packing,
                share_prompts=cfg.share_prompts,
            )
            total = sum(mb.num_loss_tokens for mb in mbs)
            optimizer.zero_grad(set_to_none=True)
            if use_gae:
                critic_optimizer.zero_grad(set_to_none=True)
            for mb in dp.share(mbs) if dp else mbs:
                mb.advantages = spread(mb, [adv[i] for i in idx])
                loss, st = _micro_batch_loss(model, mb, mb.prox_logprobs, cfg, temperature, total, ref_model)
                loss.backward()
                weight = st["loss_tokens"] / max(total, 1)
                behav_weight_max = _add_stats(sums, loss, st, weight, behav_weight_max)
                if use_gae:
                    vloss, vclip = value_loss(
                        critic(mb),
                        spread(mb, [old_values[i] for i in idx]),
                        spread(mb, [returns[i] for i in idx]),
                        mb.loss_mask,
                        cfg.value_clip,
                        total,
                    )
                    vloss.backward()
                    sums["value_loss"] += float(vloss.detach())
                    sums["value_clip_fraction"] += vclip * weight
            if dp:
                dp.all_reduce_grads(list(model.parameters()))
                if use_gae:
                    dp.all_reduce_grads(list(critic.parameters()))
            step_sums["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
            optimizer.step()
            scheduler.step()
            if use_gae:
                step_sums["critic_grad_norm"] += float(
                    torch.nn.utils.clip_grad_norm_(critic.parameters(), cfg.max_grad_norm)
                )
                critic_optimizer.step()
            steps += 1
    if dp:
        sums, behav_weight_max = dp.sum(sums), dp.max(behav_weight_max)
    for key, value in (sums | step_sums).items():
        stats[key] = value / max(steps, 1)
    stats["behav_weight_max"] = behav_weight_max
    stats["optimizer_steps"] = float(steps)
    stats["lr"] = scheduler.get_last_lr()[0]
    stats["loss_tokens"] = float(sum(sum(t.loss_mask) for t in trajs))
    return stats
