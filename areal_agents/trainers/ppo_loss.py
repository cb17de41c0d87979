"""Decoupled PPO loss (AReaL): clip against the proximal policy, weight by the behavior importance ratio.

Notation: π_θ the policy being trained, π_prox the proximal policy (the weights at the start of this
update, logprobs recomputed by the trainer), π_behav the behavior policy (the possibly older weights
that generated the tokens, logprobs reported by the engine). For each generated token t with
advantage A_t:

    r_t   = π_θ(a_t) / π_prox(a_t)                                   (the PPO ratio)
    w_t   = π_prox(a_t) / π_behav(a_t)                               (behavior importance weight)
    L_t   = w_t · max(-A_t · r_t, -A_t · clip(r_t, 1 - ε, 1 + ε_high))
    (dual clip, A_t < 0:  L_t = min(L_t, w_t · (-A_t) · c))
    L     = Σ_t m_t L_t / N        m_t = 0 where w_t > cap (stale or off-policy tokens are dropped;
                                   with ``behav_imp_weight_mode="clamp"`` they count with w_t = cap instead)

N is the number of loss tokens (token-weighted mean); pass ``num_tokens`` to normalise several
micro-batches by their shared total.

Stats are 0-dim float64 tensors on the inputs' device, never read here: reading one is a host sync (on
CUDA a stall before ``backward``), so the trainer brings a whole step's to the host at once (`host_stats`).
Each equals the Python float it replaces (a float32 sum or an integer count in float64 is exact, and a
float64 division is the same on either side). When π_behav = π_prox (on-policy) w_t = 1 and this is PPO; when
also π_θ = π_prox (first step) the gradient is the plain policy gradient -A_t ∇log π_θ(a_t).
"""

from __future__ import annotations

import torch


def decoupled_ppo_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    dual_clip: float | None = None,
    behav_imp_weight_cap: float | None = None,
    behav_imp_weight_mode: str = "mask",
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return ``(loss, stats)``; every tensor argument has the same shape (tokens, any layout)."""
    mask = loss_mask.bool()
    ratio = torch.exp(logp - logp_prox)
    clipped_ratio = ratio.clamp(1.0 - eps_clip, 1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher))
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * clipped_ratio
    pg_loss = torch.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    if dual_clip is not None:
        dual_bound = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (pg_loss > dual_bound)
        pg_loss = torch.where(advantages < 0, torch.minimum(pg_loss, dual_bound), pg_loss)
    else:
        dual_clipped = torch.zeros_like(mask)

    behav_weight = torch.exp(logp_prox - logp_behav).detach()
    if behav_imp_weight_cap is not None:
        capped = mask & (behav_weight > behav_imp_weight_cap)
        if behav_imp_weight_mode == "mask":
            mask = mask & ~capped
        elif behav_imp_weight_mode == "clamp":
            behav_weight = behav_weight.clamp(max=behav_imp_weight_cap)
        else:
            raise ValueError(f"behav_imp_weight_mode: expects 'mask' or 'clamp', got {behav_imp_weight_mode!r}")
    else:
        capped = torch.zeros_like(mask)

    n = float(num_tokens) if num_tokens is not None else loss_mask.bool().sum().clamp(min=1)
    loss = (pg_loss * behav_weight * mask).sum() / n

    valid = loss_mask.bool()
    with torch.no_grad():
        count = valid.sum().clamp(min=1).double()

        def mean(x: torch.Tensor) -> torch.Tensor:
            return x.sum().double() / count

        stats = {
            "loss_tokens": valid.sum().double(),
            "clip_fraction": mean(clipped & mask),
            "dual_clip_fraction": mean(dual_clipped & mask),
            "capped_fraction": mean(capped),
            "approx_kl": mean((logp_prox - logp) * valid),  # KL(π_prox || π_θ), k1
            "ratio_mean": mean(ratio * valid),
            "behav_weight_mean": mean(behav_weight * valid),
            # w_t >= 0: the largest over no tokens is 0
            "behav_weight_max": torch.where(valid, behav_weight, 0.0).max().double(),
        }
    return loss, stats


def kl_to_reference(
    logp: torch.Tensor, logp_ref: torch.Tensor, loss_mask: torch.Tensor, num_tokens: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(π_θ || π_ref) per loss token by the k3 estimator (as in GRPO), ``exp(d) - d - 1`` with
    ``d = log π_ref - log π_θ``: non-negative, unbiased, low variance. Returns ``(penalty, mean KL)``."""
    d = logp_ref - logp
    kl = torch.exp(d) - d - 1.0
    mask = loss_mask.bool()
    n = float(num_tokens) if num_tokens is not None else mask.sum().clamp(min=1)
    with torch.no_grad():
        mean = (kl * mask).sum().double() / mask.sum().clamp(min=1).double()
    return (kl * mask).sum() / n, mean


def mismatch_stats(logp_train: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The train/inference mismatch over ``mask``'s tokens (those the engine generated with the weights the
    trainer scores them with): the sum of KL(π_behav || π_train) by the k3 estimator, ``r - 1 - log r`` with
    ``r = π_train / π_behav`` (non-negative, unbiased for samples of π_behav), the token count, and the largest
    ``|log π_train - log π_behav|``. Sums, so micro-batches and ranks add up."""
    keep = mask.bool()
    with torch.no_grad():  # 0 off the mask (no boolean indexing: its size is a host sync)
        d = torch.where(keep, logp_train - logp_behav, 0.0).double()
        return {
            "mismatch_kl_sum": (torch.exp(d) - 1.0 - d).sum(),
            "mismatch_tokens": keep.sum().double(),
            "mismatch_max_abs": d.abs().max() if d.numel() else d.new_zeros(()),
        }


def sequence_ratio_mask(
    log_ratio: torch.Tensor,
    loss_mask: torch.Tensor,
    slices: list[tuple[int, int, int]],
    low: float | None,
    high: float | None,
) -> torch.Tensor:
    """``loss_mask`` with every trajectory whose geometric-mean behavior ratio, ``exp(mean log π_prox/π_behav)``
    over its loss tokens, leaves ``[low, high]`` masked out whole (sequence-level masking of the train/inference
    mismatch); ``slices[k] = (row, start, end)`` of trajectory k, as in `MicroBatch`. None: no bound that side."""
    out = loss_mask.clone()
    for row, a, b in slices:  # on the device, not read: a trajectory with no loss tokens has none to mask
        m = loss_mask[row, a:b].bool()
        mean = torch.where(m, log_ratio[row, a:b], 0.0).double().sum() / m.sum().clamp(min=1)
        ratio = torch.exp(mean)
        outside = torch.zeros((), dtype=torch.bool, device=ratio.device)
        if low is not None:
            outside |= ratio < low
        if high is not None:
            outside |= ratio > high
        out[row, a:b] *= (~outside).to(out.dtype)
    return out
