"""Per-row sampling from next-token logits, with the behavior logprob of each sampled token.

The behavior logprob is ``log softmax(logits / T)`` at the sampled token (``T = 1`` for greedy rows),
over the full vocabulary (`tempered_log_softmax`, which the trainer's recompute calls too), so the
importance ratio is exact.
Top-k / top-p only restrict which tokens may be drawn. A row with its own seed (``SamplingParams.seed``,
SGLang's ``sampling_seed``) draws from `seeded_uniform` of its seed and the token's position instead of the
engine-wide generator, so its tokens do not depend on which other rows share the batch, nor on a resubmission.
"""

from __future__ import annotations

import math

import torch

from areal_agents.models.logprobs import tempered_log_softmax


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generator: torch.Generator | None = None,
    draws: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits [B, V]``; return ``(tokens [B], logprobs [B])``.

    ``temperature``, ``top_p`` (floats) and ``top_k`` (ints, 0 = off) are ``[B]`` tensors; a row with
    temperature 0 is greedy. ``draws``: ``[B]`` float64 uniforms in (0, 1] for rows with their own seed
    (`seeded_uniform`), NaN for rows that draw from ``generator``. Raises ValueError for rows whose logits
    are not finite (NaN or inf), as ``torch.multinomial`` refuses them.
    """
    u = uniforms(logits.shape[0], logits.device, generator, draws)
    tokens, logprobs, ok = sample_rows(logits, temperature, top_p, top_k, u)
    if not bool(ok.all()):
        bad = (~ok).nonzero().squeeze(1).tolist()
        raise ValueError(f"sample_tokens: next-token logits of rows {bad[:8]} are not finite (NaN or inf)")
    return tokens, logprobs


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    u: torch.Tensor,
    *,
    use_top_k: bool | None = None,
    use_top_p: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sample_tokens` with nothing read on the host: ``(tokens [B], logprobs [B], ok [B])``, ``ok`` False
    for a row whose logits are not finite (its token is then arbitrary); ``u``: `uniforms`.

    ``use_top_k`` / ``use_top_p``: whether any row has top-k / top-p on, decided by the caller from its
    requests (None: read from ``top_k`` / ``top_p``, a host sync each); False skips that filter's sort."""
    greedy = temperature <= 0
    logprobs_all = tempered_log_softmax(logits, temperature)

    filtered = logprobs_all
    vocab = logprobs_all.shape[-1]
    if use_top_k if use_top_k is not None else bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = torch.sort(filtered, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if use_top_p if use_top_p is not None else bool((top_p < 1).any()):
        sorted_lp, order = torch.sort(filtered, dim=-1, descending=True)
        probs = sorted_lp.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
        filtered = filtered.scatter(1, order, sorted_lp.masked_fill(drop, float("-inf")))

    sampled, ok = _inverse_cdf(filtered.exp(), u)
    tokens = torch.where(greedy, logprobs_all.argmax(-1), sampled)
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1), ok


def uniforms(
    n: int, device: torch.device, generator: torch.Generator | None, draws: torch.Tensor | None = None
) -> torch.Tensor:
    """``[n, 1]`` float64 uniforms in (0, 1] for `sample_rows`: ``draws`` where not NaN (rows with their own
    seed), else from ``generator`` (one draw of ``n``, whatever ``draws`` holds)."""
    u = 1.0 - torch.rand(n, 1, dtype=torch.float64, generator=generator, device=device)  # (0, 1]
    if draws is not None:  # rows with their own seed
        draws = draws.to(u.device)[:, None]
        u = torch.where(torch.isnan(draws), u, draws)
    return u


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform in (0, 1] from a request's seed and the position of the token it samples (splitmix64 of
    both): the same token of the same request draws the same number in any batch, on any device."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & mask
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z = ((z ^ (z >> shift)) * mult) & mask
    z ^= z >> 31
    return ((z >> 11) + 1) / float(1 << 53)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One index a row drawn in proportion to ``weights [B, V]`` (unnormalised, >= 0): the first whose
    cumulative weight reaches the share ``u [B, 1]`` of the row's total (never a zero-weight token); and
    whether the row could be drawn from (a finite, positive total).
    ``torch.multinomial`` does the same with an exponential draw per token: on the engine's decode step it
    cost more than the whole draw here. The sums are in float64 so that tail tokens keep their share."""
    cdf = weights.double().cumsum(-1)
    total = cdf[:, -1:]
    ok = (torch.isfinite(total) & (total > 0)).squeeze(1)
    return torch.searchsorted(cdf, u * total).squeeze(1).clamp(max=weights.shape[-1] - 1), ok


def seeded_draws(seeds: list[int | None], positions: list[int]) -> torch.Tensor | None:
    """[B] float64: each seeded row's uniform for the token it samples at its position (`seeded_uniform`), NaN
    for the rows without a seed; None when no row has one."""
    if all(seed is None for seed in seeds):
        return None
    draws = [math.nan if seed is None else seeded_uniform(seed, p) for seed, p in zip(seeds, positions)]
    return torch.tensor(draws, dtype=torch.float64)


def unsampleable(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[B] rows `sample_tokens` refuses: their temperature-scaled log-probabilities are NaN or all -inf."""
    logprobs = tempered_log_softmax(logits, temperature)
    return torch.isnan(logprobs).any(-1) | ~torch.isfinite(logprobs).any(-1)
