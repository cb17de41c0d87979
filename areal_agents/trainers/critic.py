"""A critic and GAE: per-token advantages from a learned value of each prefix (PPO's original recipe).

The policy's tokens of one trajectory form the time axis; env and prompt tokens are part of the state.
For the generated tokens t = 1..K, with V_t the value of the prefix before token t and r_t = 0 except
r_K = the trajectory's (shaped) reward:

    δ_t = r_t + γ V_{t+1} - V_t        (V_{K+1} = 0: the episode ends)
    A_t = δ_t + γ λ A_{t+1}            returns R_t = A_t + V_t

The critic is trained on R_t with PPO's clipped value loss. Each segment of a history-rewriting episode
ends with the episode's reward, as if it ended the episode.

In a PPO update (`ppo.py`): `gae_targets` before the first step (values, advantages, returns), then
per micro-batch `critic_backward` beside the policy's, and `critic_step` after the policy's step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from areal_agents.config import PPOConfig
from areal_agents.trainers.batching import hidden_states, module_device, per_trajectory
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.microbatch import MicroBatch, spread
from areal_agents.trainers.optim import optimizer_step
from areal_agents.types import Trajectory


class ValueModel(nn.Module):
    """The transformer body of a causal LM with a scalar head: a value for every prefix.

    ``lm`` must be the critic's own copy (e.g. ``load_model(path)``): its body is trained, its LM head dropped.
    """

    def __init__(self, lm: PreTrainedModel) -> None:
        super().__init__()
        self.body = lm.get_decoder()
        self.head = nn.Linear(lm.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # values start at 0: the first advantages are the rewards
        nn.init.zeros_(self.head.bias)

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        """``V`` of the prefix before each token, laid out like ``mb.input_ids``; 0 at position 0."""
        hidden = hidden_states(self.body, mb)
        values = self.head(hidden[:, :-1]).squeeze(-1).float()  # the state after position t, before token t + 1
        values = nn.functional.pad(values, (1, 0))
        if mb.cu_seqlens is not None:
            values[0, mb.cu_seqlens[:-1].long()] = 0.0  # a trajectory's first token has no prefix of its own
        return values


def gae(
    values: torch.Tensor, loss_mask: torch.Tensor, reward: float, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` of one trajectory (1-D tensors laid out like its tokens, 0 off the mask)."""
    positions = loss_mask.nonzero().flatten().tolist()
    advantages = torch.zeros_like(values)
    next_value, running = 0.0, 0.0
    for k, t in enumerate(reversed(positions)):
        r = reward if k == 0 else 0.0
        delta = r + gamma * next_value - float(values[t])
        running = delta + gamma * lam * running
        advantages[t] = running
        next_value = float(values[t])
    returns = (advantages + values) * loss_mask
    return advantages, returns


def whiten(per_trajectory: list[torch.Tensor], masks: list[torch.Tensor], eps: float = 1e-8) -> list[torch.Tensor]:
    """Advantages shifted and scaled to mean 0, std 1 over all loss tokens of the batch."""
    flat = torch.cat([a[m.bool()] for a, m in zip(per_trajectory, masks)])
    if flat.numel() < 2:
        return per_trajectory
    mean, std = flat.mean(), flat.std(unbiased=False)
    return [(a - mean) / (std + eps) * m for a, m in zip(per_trajectory, masks)]


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    value_clip: float | None,
    num_tokens: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss ``½ max((V - R)², (V_clip - R)²)`` summed over loss tokens / ``num_tokens``;
    returns ``(loss, fraction of tokens where the clipped term was larger)``, the fraction a 0-dim float64
    tensor on the device (read with the step's other stats, `host_stats`)."""
    mask = loss_mask.bool()
    err = (values - returns) ** 2
    if value_clip is not None:
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        err_clipped = (clipped - returns) ** 2
        used = err_clipped > err
        err = torch.maximum(err, err_clipped)
    else:
        used = torch.zeros_like(mask)
    loss = 0.5 * (err * mask).sum() / max(num_tokens, 1.0)
    with torch.no_grad():
        fraction = (used & mask).sum().double() / mask.sum().clamp(min=1).double()
    return loss, fraction


@torch.no_grad()
def critic_values(
    critic: ValueModel,
    trajectories: Sequence[Trajectory],
    max_tokens: int,
    pad: int,
    pack: bool = False,
    dp: DataParallel | None = None,
    share_prompts: bool = False,
) -> list[torch.Tensor]:
    """The critic's value of the prefix before every token of every trajectory."""
    return per_trajectory(critic, trajectories, max_tokens, pad, pack, dp, share_prompts, module_device(critic))


def gae_targets(
    critic: ValueModel,
    trajectories: Sequence[Trajectory],
    rewards: Sequence[float],
    cfg: PPOConfig,
    pad_token_id: int,
    dp: DataParallel | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
    """``(values, advantages, returns, sums)`` per trajectory before an update: the critic's values, GAE
    advantages (whitened over the batch with ``cfg.whiten_advantages``) and returns; ``sums`` over loss
    tokens for the stats (``advantage_count`` tokens, ``advantage_abs_sum``, ``value_sum``, ``return_sum``)."""
    critic.train()
    masks = [torch.tensor(t.loss_mask, dtype=torch.float) for t in trajectories]
    values = critic_values(
        critic, trajectories, cfg.micro_batch_tokens, pad_token_id, cfg.packing, dp, cfg.share_prompts
    )
    pairs = [gae(v, m, r, cfg.gamma, cfg.lam) for v, m, r in zip(values, masks, rewards)]
    advantages, returns = [a for a, _ in pairs], [r for _, r in pairs]
    if cfg.whiten_advantages:
        advantages = whiten(advantages, masks)
    sums = {
        "advantage_count": float(sum(m.sum() for m in masks)),
        "advantage_abs_sum": float(sum((a.abs() * m).sum() for a, m in zip(advantages, masks))),
        "value_sum": float(sum((v * m).sum() for v, m in zip(values, masks))),
        "return_sum": float(sum(r.sum() for r in returns)),
    }
    return values, advantages, returns, sums


def critic_backward(
    critic: ValueModel,
    mb: MicroBatch,
    old_values: Sequence[torch.Tensor],
    returns: Sequence[torch.Tensor],
    value_clip: float | None,
    num_tokens: float,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward (in ``context``: the compute dtype's) and backward of `value_loss` on one micro-batch
    (per-trajectory ``old_values`` and ``returns`` indexed like its trajectories); returns ``(loss,
    clipped fraction)``, detached 0-dim tensors on the device."""
    with context():
        values = critic(mb)
    loss, clipped = value_loss(
        values, spread(mb, old_values), spread(mb, returns), mb.loss_mask, value_clip, num_tokens
    )
    loss.backward()
    return loss.detach(), clipped


def critic_step(critic: ValueModel, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> float:
    """Clip (the global norm, summed over ranks when sharded) and step; the gradient norm before clipping."""
    return optimizer_step(critic, optimizer, max_grad_norm)
