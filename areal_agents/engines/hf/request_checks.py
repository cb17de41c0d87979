"""Checks a generation request passes before it reaches `HFEngine`'s decode thread.

One bad request must not take the engine down: a token id outside the vocabulary fails the embedding
lookup of the whole batch, and a context past the model's positions decodes garbage. `check_request`
refuses such requests with `RequestError` (serve-model: a 400) naming the field (and a LoRA adapter the
engine does not hold, naming it), and caps
``max_new_tokens`` at the context left, so a long request ends with stop reason ``length`` (as SGLang
caps it at its context length).

    limits = RequestLimits.of(model)                     # vocabulary and max_position_embeddings
    request = check_request(request, limits)             # RequestError, or the request, capped
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from areal_agents.errors import RequestError, did_you_mean  # RequestError re-exported: the checks raise it
from areal_agents.types import GenRequest

SAMPLING_EPS = 1e-6  # the smallest temperature (other than 0) and top_p: the sampler computes in float32
MAX_TOP_K = 1 << 30  # SGLang's "all tokens"; larger values are not int64-safe in every path
SEED_BOUND = 1 << 63  # a request's seed fits an int64


@dataclass(frozen=True)
class RequestLimits:
    """What a model can take: token ids below ``vocab_size``; at most ``context`` positions (prompt + output)."""

    vocab_size: int
    context: int | None = None  # None: no known limit

    @classmethod
    def of(cls, model: Any) -> RequestLimits:
        """The limits of a transformers model: its input embedding's rows and ``max_position_embeddings``."""
        embeddings = model.get_input_embeddings()
        vocab = getattr(embeddings, "num_embeddings", None) or model.config.vocab_size
        context = getattr(model.config, "max_position_embeddings", None)
        return cls(int(vocab), int(context) if context else None)


def check_request(
    request: GenRequest,
    limits: RequestLimits,
    *,
    ids_field: str = "input_ids",
    params_field: str = "sampling",
    adapters: Collection[str] = (),
    lora_field: str = "lora_name",
) -> GenRequest:
    """``request`` with ``max_new_tokens`` capped at the context left, or `RequestError` naming the field.

    ``ids_field`` / ``params_field`` / ``lora_field`` are the names the caller knows the prompt, the sampling
    parameters and the adapter by (serve-model: ``input_ids[2]``, ``sampling_params``, ``lora_path``);
    ``adapters``: the LoRA adapters the engine holds (a request's ``lora_name`` must be one).
    """
    ids = request.input_ids
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"{ids_field}: expects a non-empty list of token ids, got {_short(ids)}")
    n = len(ids)
    if limits.context is not None and n >= limits.context:  # before the token loop: a huge prompt fails at once
        raise RequestError(
            f"{ids_field}: the prompt has {n} tokens; the model's context is {limits.context} positions "
            f"(max_position_embeddings), so a prompt may have at most {limits.context - 1}: shorten it"
        )
    check_token_ids(ids, limits, ids_field)
    sp = request.sampling
    check_sampling(sp, params_field)
    check_adapter(request.lora_name, adapters, lora_field)
    if limits.context is None:
        return request
    room = limits.context - n
    if sp.max_new_tokens <= room:
        return request
    return dataclasses.replace(request, sampling=dataclasses.replace(sp, max_new_tokens=room))


def check_token_ids(ids: Any, limits: RequestLimits, field: str) -> None:
    """``ids`` is a non-empty list of ints in ``[0, vocab_size)``, or `RequestError` names the first bad one."""
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"{field}: expects a non-empty list of token ids, got {_short(ids)}")
    if not all(type(t) is int for t in ids):  # the fast check; numpy ints and the like take the slow one
        for i, t in enumerate(ids):
            if not _is_int(t):
                raise RequestError(f"{field}[{i}]: expects a token id (an int), got {_short(t)}")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= limits.vocab_size:
        i = next(i for i, t in enumerate(ids) if not 0 <= t < limits.vocab_size)
        raise RequestError(
            f"{field}[{i}]: token id {ids[i]} is out of range: the model's vocabulary has {limits.vocab_size} "
            f"tokens (ids 0 to {limits.vocab_size - 1})"
        )


def check_adapter(name: Any, adapters: Collection[str], field: str = "lora_name") -> None:
    """``name`` is None (the base model) or a LoRA adapter in ``adapters``, else `RequestError` names it."""
    if name is None or (isinstance(name, str) and name in adapters):
        return
    loaded = ", ".join(sorted(adapters)) or "none"
    raise RequestError(
        f"{field}: LoRA adapter {_short(name)} is not loaded (loaded: {loaded}); load it first "
        f"(load_lora_adapter).{did_you_mean(str(name), adapters)}"
    )


def check_sampling(sp: Any, field: str) -> None:
    """Numbers the sampler would choke on (NaN, infinite, negative, past int64, a float32 zero) fail here
    rather than in a shared decode step: `RequestError` naming ``field.key``. ``sp``: a `SamplingParams`, or
    anything with its attributes (serve-model checks a request's values before it makes one)."""
    if not _is_int(sp.max_new_tokens) or sp.max_new_tokens < 1:
        raise RequestError(f"{field}.max_new_tokens: expects an int >= 1, got {_short(sp.max_new_tokens)}")
    t = sp.temperature
    if not (_is_real(t) and (t == 0 or SAMPLING_EPS <= t)):
        raise RequestError(
            f"{field}.temperature: expects 0 (greedy) or a finite number >= {SAMPLING_EPS} (smaller ones overflow "
            f"the logits), got {_short(t)}"
        )
    if not (_is_real(sp.top_p) and SAMPLING_EPS <= sp.top_p <= 1):
        raise RequestError(f"{field}.top_p: expects a number in [{SAMPLING_EPS}, 1], got {_short(sp.top_p)}")
    if not _is_int(sp.top_k) or not 0 <= sp.top_k <= MAX_TOP_K:
        raise RequestError(f"{field}.top_k: expects an int in [0, {MAX_TOP_K}] (0: off), got {_short(sp.top_k)}")
    if sp.seed is not None and not (_is_int(sp.seed) and -SEED_BOUND <= sp.seed < SEED_BOUND):
        raise RequestError(f"{field}.seed: expects an int in [-2**63, 2**63) or None, got {_short(sp.seed)}")
    if not all(_is_int(t) for t in sp.stop_token_ids):
        raise RequestError(f"{field}.stop_token_ids: expects a list of token ids, got {_short(sp.stop_token_ids)}")


def _is_real(value: Any) -> bool:
    """A finite number (an int too large for a float is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # a JSON true is not a token id


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
