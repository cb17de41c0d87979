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
    check_token_ids(request.input_ids, limits, ids_field)
    sp = request.sampling
    _check_sampling(sp, params_field)
    check_adapter(request.lora_name, adapters, lora_field)
    n = len(request.input_ids)
    if limits.context is None:
        return request
    if n >= limits.context:
        raise RequestError(
            f"{ids_field}: the prompt has {n} tokens; the model's context is {limits.context} positions "
            f"(max_position_embeddings), so a prompt may have at most {limits.context - 1}: shorten it"
        )
    room = limits.context - n
    if sp.max_new_tokens <= room:
        return request
    return dataclasses.replace(request, sampling=dataclasses.replace(sp, max_new_tokens=room))


def check_token_ids(ids: Any, limits: RequestLimits, field: str) -> None:
    """``ids`` is a non-empty list of ints in ``[0, vocab_size)``, or `RequestError` names the first bad one."""
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"{field}: expects a non-empty list of token ids, got {_short(ids)}")
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


def _check_sampling(sp: Any, field: str) -> None:
    """Numbers the sampler would choke on (NaN, negative) fail here rather than in a shared decode step."""
    if not _is_int(sp.max_new_tokens) or sp.max_new_tokens < 1:
        raise RequestError(f"{field}.max_new_tokens: expects an int >= 1, got {_short(sp.max_new_tokens)}")
    if not (isinstance(sp.temperature, (int, float)) and sp.temperature >= 0 and not math.isnan(sp.temperature)):
        raise RequestError(f"{field}.temperature: expects a number >= 0 (0: greedy), got {_short(sp.temperature)}")
    if not (isinstance(sp.top_p, (int, float)) and 0 < sp.top_p <= 1):
        raise RequestError(f"{field}.top_p: expects a number in (0, 1], got {_short(sp.top_p)}")
    if not _is_int(sp.top_k) or sp.top_k < 0:
        raise RequestError(f"{field}.top_k: expects an int >= 0 (0: off), got {_short(sp.top_k)}")
    if sp.seed is not None and not _is_int(sp.seed):
        raise RequestError(f"{field}.seed: expects an int or None, got {_short(sp.seed)}")
    if not all(_is_int(t) for t in sp.stop_token_ids):
        raise RequestError(f"{field}.stop_token_ids: expects a list of token ids, got {_short(sp.stop_token_ids)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # a JSON true is not a token id


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
