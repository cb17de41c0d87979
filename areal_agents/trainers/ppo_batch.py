"""What a PPO update trains on: the first stage of `ppo.py`'s one update path (prepare -> accumulate -> step).

`prepare_batch` shapes the rewards (DAPO's soft overlong punishment first, `overlong.py`) and keeps the
trajectories that carry signal: with group advantages (GRPO, Dr.GRPO, RLOO) zero-variance groups are
dropped and every loss token gets its trajectory's advantage; with GAE the critic is the baseline, every
trajectory is kept and each token gets its own advantage and return (`critic.gae_targets`). With
``ppo.overlong_filtering`` truncated trajectories are then left out, after advantages (their loss masked,
as DAPO does; with GAE they train neither the policy nor the critic). With more than one optimizer step per
batch it also scores π_prox, the weights as they are before the first step. The batch's stats come from sums
(`counts`) that a streamed batch adds up over its parts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel

from areal_agents.config import PPOConfig
from areal_agents.models.device import autocast, compute_dtype
from areal_agents.trainers.advantages import group_advantages, shape_rewards, zero_variance_groups
from areal_agents.trainers.batching import make_micro_batches, module_device, per_trajectory, token_logprobs
from areal_agents.trainers.critic import ValueModel, gae_targets
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.microbatch import MicroBatch
from areal_agents.trainers.overlong import is_truncated, overlong_penalties
from areal_agents.types import Trajectory


@dataclass
class PreparedBatch:
    """The trajectories to train and, per trajectory, 1-D tensors laid out like its tokens."""

    trajectories: list[Trajectory]
    advantages: list[torch.Tensor]  # 0 off the loss mask
    counts: dict[str, float] = field(default_factory=dict)  # sums behind `batch_stats`
    prox: list[torch.Tensor] | None = None  # π_prox; None: each step's own forward, detached
    old_values: list[torch.Tensor] | None = None  # GAE: the critic's values before the update
    returns: list[torch.Tensor] | None = None  # GAE: the critic's targets

    def select(self, idx: Sequence[int]) -> PreparedBatch:
        """The trajectories ``idx`` (a minibatch), in that order; no counts."""

        def pick(xs: list | None) -> list | None:
            return None if xs is None else [xs[i] for i in idx]

        return PreparedBatch(
            pick(self.trajectories),
            pick(self.advantages),
            {},
            pick(self.prox),
            pick(self.old_values),
            pick(self.returns),
        )

    def micro_batches(self, cfg: PPOConfig, pad_token_id: int) -> list[MicroBatch]:
        """Token-budgeted micro-batches of the trajectories (π_prox riding along when scored)."""
        return make_micro_batches(
            self.trajectories,
            cfg.micro_batch_tokens,
            pad_token_id=pad_token_id,
            prox_logprobs=self.prox,
            pack=cfg.packing,
            share_prompts=cfg.share_prompts,
        )


def precision(model: torch.nn.Module, cfg: PPOConfig) -> Callable[[], contextlib.AbstractContextManager]:
    """The context of a forward pass: autocast to ``cfg.compute_dtype`` on the model's device when it is
    not sharded (FSDP2 casts a sharded one itself); nothing at all in float32 (the CPU path)."""
    if isinstance(model, FSDPModule):
        return contextlib.nullcontext
    device = module_device(model)
    dtype = compute_dtype(device, cfg.compute_dtype)
    return lambda: autocast(device, dtype)


def prepare_batch(
    model: PreTrainedModel,
    trajectories: list[Trajectory],
    cfg: PPOConfig,
    *,
    temperature: float,
    pad_token_id: int,
    critic: ValueModel | None = None,
    dp: DataParallel | None = None,
    max_new_tokens: int | None = None,
) -> PreparedBatch:
    """Advantages (and GAE's values and returns) of the trajectories to train; π_prox when the update takes
    more than one optimizer step. Puts ``model`` in training mode when there is anything to train.
    ``max_new_tokens`` (``rollout.max_new_tokens``) is the Lmax of the soft overlong punishment."""
    if cfg.advantage == "gae" and critic is None:
        raise ValueError("ppo.advantage=gae needs a critic and its optimizer")
    rewards, counts = _rewards(trajectories, cfg, max_new_tokens)
    # GRPO groups are (prompt, agent role): in a multi-agent episode each role is compared with itself
    group_ids = [f"{t.group_id}/{t.agent_id}" for t in trajectories]
    flat = zero_variance_groups(rewards, group_ids)
    counts |= {"groups": float(len(set(group_ids))), "flat_groups": float(len(flat))}
    if cfg.advantage == "gae":  # the critic is the baseline: every trajectory carries signal
        keep = list(range(len(trajectories)))
    elif cfg.advantage == "baseline":  # each trajectory against the running baseline it carries (the gateway's)
        advantages = torch.tensor(rewards) - torch.tensor(_baselines(trajectories, cfg))
        zero = [a == 0 for a in advantages.tolist()]  # as a flat group: no gradient
        counts |= {"groups": float(len(trajectories)), "flat_groups": float(sum(zero))}
        keep = [i for i, z in enumerate(zero) if not (z and cfg.filter_zero_variance_groups)]
    else:
        episode_ids = [t.episode_id or f"#{i}" for i, t in enumerate(trajectories)]
        advantages = group_advantages(rewards, group_ids, cfg.advantage, episode_ids=episode_ids)
        keep = [i for i, g in enumerate(group_ids) if not (cfg.filter_zero_variance_groups and g in flat)]
    if cfg.advantage != "gae":
        counts |= {"advantage_abs_sum": float(advantages.abs().sum()), "advantage_count": float(len(trajectories))}
    if cfg.overlong_filtering:  # after advantages: a truncated trajectory still counts in its group's baseline
        counts["overlong_filtered"] = float(sum(is_truncated(trajectories[i]) for i in keep))
        keep = [i for i in keep if not is_truncated(trajectories[i])]
    trajs = [trajectories[i] for i in keep]
    counts["trained"] = float(len(keep))
    counts["loss_tokens"] = float(sum(sum(t.loss_mask) for t in trajs))
    if not keep:
        return PreparedBatch([], [], counts)
    model.train()
    prox = None
    # With one optimizer step per batch, π_prox is the weights of that step's own forward pass: its
    # logprobs are the detached forward, exactly, so the extra no-grad pass is skipped.
    if cfg.ppo_epochs * cfg.num_minibatches > 1:
        prox = proximal_logprobs(
            model, trajs, temperature, cfg.micro_batch_tokens, pad_token_id, cfg.packing, dp, cfg.share_prompts, cfg
        )
    if cfg.advantage != "gae":
        masks = [torch.tensor(t.loss_mask, dtype=torch.float) for t in trajs]
        return PreparedBatch(trajs, [a * m for a, m in zip(advantages[keep].tolist(), masks)], counts, prox)
    with precision(critic, cfg)():
        values, adv, returns, sums = gae_targets(critic, trajs, [rewards[i] for i in keep], cfg, pad_token_id, dp)
    return PreparedBatch(trajs, adv, counts | sums, prox, values, returns)


def _baselines(trajectories: list[Trajectory], cfg: PPOConfig) -> list[float]:
    """Each trajectory's ``metadata["baseline"]``, shaped as its reward is (reward_bias, reward_scale, reward_clip)."""
    missing = [t.episode_id for t in trajectories if not isinstance(t.metadata.get("baseline"), int | float)]
    if missing:
        raise ValueError(
            f"ppo.advantage=baseline: trajectories {missing[:3]} carry no metadata['baseline'] (the gateway sets it)"
        )
    raw = [float(t.metadata["baseline"]) for t in trajectories]
    return shape_rewards(raw, cfg.reward_scale, cfg.reward_bias, cfg.reward_clip)


def _rewards(
    trajectories: list[Trajectory], cfg: PPOConfig, max_new_tokens: int | None
) -> tuple[list[float], dict[str, float]]:
    """The shaped reward of each trajectory: the soft overlong penalty added (``ppo.overlong_buffer``), then
    ``reward_bias``, ``reward_scale`` and ``reward_clip``; and the penalty's counts."""
    raw = [t.reward for t in trajectories]
    counts: dict[str, float] = {}
    if cfg.overlong_buffer:
        if max_new_tokens is None:
            raise ValueError("ppo.overlong_buffer: the soft overlong punishment needs max_new_tokens (its Lmax)")
        penalties = overlong_penalties(trajectories, max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
        raw = [r + p for r, p in zip(raw, penalties)]
        counts = {"overlong_penalty_sum": float(sum(penalties)), "overlong_scored": float(len(penalties))}
    return shape_rewards(raw, cfg.reward_scale, cfg.reward_bias, cfg.reward_clip), counts


def batch_stats(counts: dict[str, float]) -> dict[str, float]:
    """The batch's stats from its `PreparedBatch.counts` (summed over the parts of a streamed batch)."""
    stats = {
        "zero_variance_group_fraction": counts["flat_groups"] / max(counts["groups"], 1.0),
        "trained_trajectories": counts["trained"],
    }
    if "advantage_count" in counts:  # per trajectory (group advantages) or per loss token (GAE)
        stats["advantage_abs_mean"] = counts["advantage_abs_sum"] / max(counts["advantage_count"], 1.0)
    if "overlong_scored" in counts:  # per trajectory, before reward_bias and reward_scale
        stats["overlong_penalty_mean"] = counts["overlong_penalty_sum"] / max(counts["overlong_scored"], 1.0)
    if "overlong_filtered" in counts:
        stats["overlong_filtered_trajectories"] = counts["overlong_filtered"]
    if "value_sum" in counts:
        n_tokens = max(counts["advantage_count"], 1.0)
        stats["value_mean"] = counts["value_sum"] / n_tokens
        stats["return_mean"] = counts["return_sum"] / n_tokens
    return stats


def add_counts(total: dict[str, float], part: dict[str, float]) -> None:
    """Add a streamed part's counts to the batch's."""
    for key, value in part.items():
        total[key] = total.get(key, 0.0) + value


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
    cfg: PPOConfig | None = None,
) -> list[torch.Tensor]:
    """π_prox logprobs of every token of every trajectory, with the weights as they are now (in
    ``cfg.compute_dtype`` when given)."""
    context = precision(model, cfg) if cfg is not None else contextlib.nullcontext

    def score(mb: MicroBatch) -> torch.Tensor:
        with context():
            return token_logprobs(model, mb, temperature)

    return per_trajectory(score, trajectories, max_tokens, pad, pack, dp, share_prompts, module_device(model))
