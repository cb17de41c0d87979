"""The Tinker losses per token, and the checks of what a client sends them (datums, loss config).

Sums, no normalisation, as the Tinker service computes them (the client normalises its weights itself).
With lp_t = log π_θ(target_t | tokens ≤ t) (the current adapter) and q_t = the sampler's logprob (π_behav):

- ``cross_entropy`` (``weights`` w):          L = Σ_t -lp_t · w_t            (any w, negative included)
- ``importance_sampling`` (``logprobs`` q, ``advantages`` A):  L = Σ_t -r_t · A_t,  r_t = exp(lp_t - q_t)
- ``ppo`` (the same, ``clip_low_threshold`` lo / ``clip_high_threshold`` hi, default 0.8 / 1.2):
  L = Σ_t -min(r_t · A_t, clip(r_t, lo, hi) · A_t)
- ``cispo`` (the same, lo / hi default 0 / 4):  L = Σ_t -sg(clip(r_t, lo, hi)) · lp_t · A_t
- ``dro`` (the same, ``beta`` required: Tinker documents no default):  L = Σ_t -(lp_t · A_t - β/2 · (lp_t - q_t)²)

The formulas and defaults are Tinker's documentation's (tinker-docs.thinkingmachines.ai/tinker/losses). ``gspo``'s
defaults and ``stable_reinforce``'s formula are not published: both are refused by name.

Alignment (no shift here: the client shifted): a datum of T tokens has per-token inputs of length T, and
position t of the tokens predicts ``target_tokens[t]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from areal_agents.errors import TinkerUserError, did_you_mean

Inputs = dict[str, torch.Tensor]


def cross_entropy(lp: torch.Tensor, inputs: Inputs, cfg: Mapping[str, float]) -> torch.Tensor:
    return -lp * inputs["weights"]


def importance_sampling(lp: torch.Tensor, inputs: Inputs, cfg: Mapping[str, float]) -> torch.Tensor:
    return -torch.exp(lp - inputs["logprobs"]) * inputs["advantages"]


def ppo(lp: torch.Tensor, inputs: Inputs, cfg: Mapping[str, float]) -> torch.Tensor:
    ratio, adv = torch.exp(lp - inputs["logprobs"]), inputs["advantages"]
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv)


def cispo(lp: torch.Tensor, inputs: Inputs, cfg: Mapping[str, float]) -> torch.Tensor:
    ratio = torch.exp(lp - inputs["logprobs"]).clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -ratio.detach() * lp * inputs["advantages"]


def dro(lp: torch.Tensor, inputs: Inputs, cfg: Mapping[str, float]) -> torch.Tensor:
    return -(lp * inputs["advantages"] - 0.5 * cfg["beta"] * (lp - inputs["logprobs"]) ** 2)


@dataclass(frozen=True)
class LossSpec:
    """A loss: its per-token inputs (besides ``target_tokens``), its config keys with defaults, its function, and
    the config keys the client must give (no default)."""

    inputs: tuple[str, ...]
    defaults: Mapping[str, float]
    elementwise: Callable[[torch.Tensor, Inputs, Mapping[str, float]], torch.Tensor]
    required: tuple[str, ...] = ()


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(("weights",), {}, cross_entropy),
    "importance_sampling": LossSpec(("logprobs", "advantages"), {}, importance_sampling),
    "ppo": LossSpec(("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, ppo),
    "cispo": LossSpec(("logprobs", "advantages"), {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, cispo),
    "dro": LossSpec(("logprobs", "advantages"), {}, dro, required=("beta",)),
}
UNPUBLISHED = {
    "gspo": "Tinker has not published its clipping defaults",
    "stable_reinforce": "it trains on stability records Tinker's sampler keeps, in a form Tinker has not published",
}


def not_served(loss_fn: str) -> str:
    """Why ``loss_fn`` (one of `UNPUBLISHED`) is refused, and what to use instead."""
    return f"{loss_fn} is not served ({UNPUBLISHED[loss_fn]}); use one of {', '.join(LOSSES)}"


def loss_spec(loss_fn: Any) -> LossSpec:
    """The `LossSpec` of ``loss_fn``; `TinkerUserError` naming it when it is not one of `LOSSES`."""
    if isinstance(loss_fn, str) and loss_fn in UNPUBLISHED:
        raise TinkerUserError(f"loss_fn: {not_served(loss_fn)}")
    if not isinstance(loss_fn, str) or loss_fn not in LOSSES:
        hint = did_you_mean(loss_fn, LOSSES) if isinstance(loss_fn, str) else ""
        raise TinkerUserError(f"loss_fn: unsupported {loss_fn!r} (supported: {', '.join(LOSSES)}).{hint}")
    return LOSSES[loss_fn]


def loss_config(loss_fn: str, config: Mapping[str, Any] | None) -> dict[str, float]:
    """The loss's config: its defaults updated by ``config`` (finite numbers, keys it takes, lo <= 1 <= hi)."""
    spec, out = loss_spec(loss_fn), dict(loss_spec(loss_fn).defaults)
    for key, value in (config or {}).items():
        if key not in out and key not in spec.required:
            takes = ", ".join([*spec.defaults, *spec.required]) or "none"
            raise TinkerUserError(f"loss_fn_config.{key}: not a parameter of {loss_fn} (it takes: {takes})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TinkerUserError(f"loss_fn_config.{key}: expects a finite number, got {value!r}")
        out[key] = float(value)
    for key in spec.required:
        if key not in out:
            raise TinkerUserError(f"loss_fn_config.{key}: {loss_fn} needs it (Tinker documents no default)")
    if "clip_low_threshold" in out and not 0 <= out["clip_low_threshold"] <= 1 <= out["clip_high_threshold"]:
        raise TinkerUserError(
            "loss_fn_config: expects 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got "
            f"{out['clip_low_threshold']} and {out['clip_high_threshold']}"
        )
    return out


def check_datum(i: int, tokens: Any, inputs: Any, loss_fn: str, vocab: int) -> tuple[list[int], Inputs]:
    """Datum ``i``'s tokens and the inputs ``loss_fn`` reads (``target_tokens`` long, the rest float32), each
    checked: tokens in [0, vocab), every input a tensor of shape [T], floats finite."""
    where = f"data[{i}]"
    if not isinstance(tokens, Sequence) or not tokens:
        raise TinkerUserError(f"{where}.model_input: expects at least one token, got {_short(tokens)}")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
        bad = next(t for t in tokens if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab))
        raise TinkerUserError(f"{where}.model_input: token {_short(bad)} is not in the vocabulary [0, {vocab})")
    if not isinstance(inputs, Mapping):
        raise TinkerUserError(f"{where}.loss_fn_inputs: expects a mapping of tensors, got {_short(inputs)}")
    return list(tokens), {
        key: _check_input(f"{where}.loss_fn_inputs.{key}", inputs, key, len(tokens), vocab, loss_fn)
        for key in ("target_tokens", *loss_spec(loss_fn).inputs)
    }


def _check_input(where: str, inputs: Mapping[str, Any], key: str, n: int, vocab: int, loss_fn: str) -> torch.Tensor:
    if key not in inputs:
        raise TinkerUserError(f"{where}: missing, and {loss_fn} needs it (present: {sorted(map(str, inputs))})")
    value = inputs[key]
    if not isinstance(value, torch.Tensor):
        raise TinkerUserError(f"{where}: expects a tensor, got {type(value).__name__}")
    if tuple(value.shape) != (n,):
        raise TinkerUserError(f"{where}: expects shape [{n}] (one per model_input token), got {list(value.shape)}")
    if key == "target_tokens":
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TinkerUserError(f"{where}: expects integer token ids, got {value.dtype}")
        if not (0 <= int(value.min()) and int(value.max()) < vocab):
            bad = value[(value < 0) | (value >= vocab)][0]
            raise TinkerUserError(f"{where}: token {int(bad)} is not in the vocabulary [0, {vocab})")
        return value.to(torch.long)
    if value.dtype == torch.bool or value.is_complex():
        raise TinkerUserError(f"{where}: expects float32 values, got {value.dtype}")
    value = value.to(torch.float32)
    if not torch.isfinite(value).all():
        raise TinkerUserError(f"{where}: has NaN or infinite values")
    return value


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
