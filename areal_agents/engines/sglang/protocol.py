"""SGLang's native HTTP JSON shapes (0.5.x) that `serve-model` speaks and `SGLangEngine` relies on.

One place for both sides: parsing a /generate body into a `GenRequest`, and turning a `GenResponse`
into SGLang's ``{"text", "output_ids", "meta_info"}`` and back. ``tests/engines/fixtures/sglang_0.5.json``
records the shapes as SGLang 0.5.x emits them. A /generate body's ``lora_path`` names the loaded LoRA adapter
each prompt is served with (one name for all, or a list with one per prompt, None for the base model), and
``sampling_params.sampling_seed`` a prompt's own sampler seed, as SGLang takes them.
"""

from __future__ import annotations

import math
import uuid
from types import SimpleNamespace
from typing import Any

from areal_agents.engines.hf.request_checks import RequestError, check_sampling
from areal_agents.engines.remote_engine import GenerateReply
from areal_agents.types import GenRequest, GenResponse, SamplingParams

# SGLang sampling params serve-model honours, with SGLang's defaults.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,  # SGLang's "off"
    "stop_token_ids": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "n": 1,
    "sampling_seed": None,  # the request's own sampler seed (None: the engine's generator)
}
# SGLang sampling params serve-model accepts only at their no-op value (they change sampling otherwise).
SAMPLING_NO_OP: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "stop": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "stream_interval": None,
}
# Top-level /generate fields of SGLang's that serve-model cannot honour: refused unless unset. It reads
# text, input_ids, sampling_params, rid, return_logprob, return_text_in_logprobs, stream, top_logprobs_num.
GENERATE_UNSET = {
    "input_embeds": None,
    "image_data": None,
    "audio_data": None,
    "video_data": None,
    "lora_id": None,
    "session_params": None,
    "custom_logit_processor": None,
    "return_hidden_states": False,
    "token_ids_logprob": None,
    "log_metrics": True,
    "modalities": None,
    "data_parallel_rank": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
}


class ProtocolError(ValueError):
    """A request body SGLang would reject (400), with the field named."""


def parse_sampling(params: dict[str, Any] | None, field: str = "sampling_params") -> SamplingParams:
    """SGLang ``sampling_params`` -> `SamplingParams`; unknown or unsupported keys, and numbers that are not
    finite or not whole where an int is due, are errors naming ``field.key``."""
    params = dict(params or {})
    for key, value in params.items():
        if key in SAMPLING_DEFAULTS:
            continue
        if key in SAMPLING_NO_OP:
            if value not in (SAMPLING_NO_OP[key], None) and value != [] and value != {}:
                raise ProtocolError(f"{field}.{key}={_short(value)} is not supported by serve-model")
            continue
        raise ProtocolError(f"Unknown sampling parameter: {field}.{key[:60]}")
    p = {**SAMPLING_DEFAULTS, **params}
    if p["n"] != 1:
        raise ProtocolError(f"{field}.n={_short(p['n'])}: serve-model generates one sample per request")
    stops = p["stop_token_ids"] or []
    if not isinstance(stops, list):
        raise ProtocolError(f"{field}.stop_token_ids: expects a list of token ids, got {_short(stops)}")
    values = {
        "max_new_tokens": _whole(p["max_new_tokens"], f"{field}.max_new_tokens"),
        "temperature": _real(p["temperature"], f"{field}.temperature"),
        "top_p": _real(p["top_p"], f"{field}.top_p"),
        "top_k": max(_whole(p["top_k"], f"{field}.top_k"), 0),  # SGLang's -1: off
        "stop_token_ids": [_whole(t, f"{field}.stop_token_ids[{i}]") for i, t in enumerate(stops)],
        "ignore_eos": bool(p["ignore_eos"]),
        "seed": _seed(p["sampling_seed"], f"{field}.sampling_seed"),
    }
    try:
        check_sampling(SimpleNamespace(**values), field)  # the ranges, named (SamplingParams says only "Expects")
    except RequestError as e:
        raise ProtocolError(str(e)) from None
    return SamplingParams(**values)


def _whole(value: Any, field: str) -> int:
    """``value`` as an int: an int, or a float with no fraction (SGLang's JSON may say 16.0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{field}: expects an integer, got {_short(value)}")
    if isinstance(value, float) and not value.is_integer():  # NaN and the infinities included
        raise ProtocolError(f"{field}: expects an integer, got {_short(value)}")
    return int(value)


def _real(value: Any, field: str) -> float:
    """``value`` as a finite float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{field}: expects a number, got {_short(value)}")
    try:
        out = float(value)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out):
        raise ProtocolError(f"{field}: expects a finite number, got {_short(value)}")
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_generate(body: dict[str, Any], tokenize, max_prompts: int | None = None) -> list[tuple[GenRequest, dict]]:
    """A /generate body -> one (request, options) per prompt; a batch is a list of ``input_ids`` or texts (at
    most ``max_prompts``, counted before any is tokenized)."""
    if not isinstance(body, dict):
        raise ProtocolError("the /generate body must be a JSON object")
    for key, value in body.items():  # other keys are ignored, as SGLang's request dataclass does
        if key in GENERATE_UNSET and value != GENERATE_UNSET[key] and value is not None:
            raise ProtocolError(f"{key} is not supported by serve-model")
    if body.get("stream"):
        raise ProtocolError("stream=true is not supported by serve-model")
    if _whole(body.get("top_logprobs_num") or 0, "top_logprobs_num") > 0:
        raise ProtocolError("top_logprobs_num is not supported by serve-model")
    if (body.get("text") is None) == (body.get("input_ids") is None):
        raise ProtocolError("give exactly one of text and input_ids")
    if body.get("input_ids") is not None:
        batch, prompts = _prompt_ids(body["input_ids"])
        _check_batch("input_ids", len(prompts), max_prompts)
    else:
        texts = body["text"]
        batch = isinstance(texts, list)
        if not all(isinstance(t, str) for t in (texts if batch else [texts])) or (batch and not texts):
            raise ProtocolError("text must be a string or a non-empty list of strings")
        _check_batch("text", len(texts) if batch else 1, max_prompts)
        prompts = [tokenize(t, f"text[{i}]") for i, t in enumerate(texts)] if batch else [tokenize(texts, "text")]
    params = body.get("sampling_params") or {}
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise ProtocolError("sampling_params: a list must have one entry per prompt")
    if not all(sp is None or isinstance(sp, dict) for sp in per_prompt):
        raise ProtocolError("sampling_params must be an object (or a list of objects, one per prompt)")
    rids = body.get("rid")
    if rids is None:
        rids = [uuid.uuid4().hex for _ in prompts]
    elif isinstance(rids, str):
        rids = [rids] if not batch else [f"{rids}-{i}" for i in range(len(prompts))]
    if not isinstance(rids, list) or len(rids) != len(prompts):
        raise ProtocolError("rid: a string, or a list with one entry per prompt")
    loras = _lora_names(body.get("lora_path"), len(prompts))
    options = {
        "return_logprob": bool(body.get("return_logprob", False)),
        "return_text_in_logprobs": bool(body.get("return_text_in_logprobs", False)),
        "batch": batch,
    }
    out = []
    for i, (rid, prompt, sp, lora) in enumerate(zip(rids, prompts, per_prompt, loras)):
        sampling = parse_sampling(sp, f"sampling_params[{i}]" if isinstance(params, list) else "sampling_params")
        request = GenRequest(str(rid), list(prompt), sampling, lora_name=lora)
        out.append((request, {**options, "sampling_params": sp or {}}))
    return out


def _check_batch(field: str, n: int, max_prompts: int | None) -> None:
    if max_prompts is not None and n > max_prompts:
        raise ProtocolError(f"{field}: a batch of {n} prompts; this server takes at most {max_prompts} (--max-n)")


def _lora_names(lora_path: Any, n: int) -> list[str | None]:
    """``lora_path`` -> the adapter of each of ``n`` prompts: a name for all, or a list of one per prompt
    (None or absent: the base model)."""
    names = lora_path if isinstance(lora_path, list) else [lora_path] * n
    if len(names) != n:
        raise ProtocolError(f"lora_path: a list must have one entry per prompt ({n}), got {len(names)}")
    for name in names:
        if name is not None and (not isinstance(name, str) or not name):
            raise ProtocolError(f"lora_path: expects a loaded adapter's name (or None: the base model), got {name!r}")
    return names


def _seed(value: Any, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not -(1 << 63) <= value < 1 << 63:
        raise ProtocolError(f"{field}: expects an integer in [-2**63, 2**63), got {_short(value)}")
    return value


def _prompt_ids(ids: Any) -> tuple[bool, list[list[int]]]:
    """``input_ids`` -> (a batch?, its prompts): a non-empty list of ints, or a non-empty list of such lists."""
    batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    if not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
        raise ProtocolError("input_ids must be a non-empty list of token ids (or a list of such lists)")
    return batch, prompts


def finish_reason(response: GenResponse) -> dict[str, Any]:
    if response.stop_reason == "stop":
        return {"type": "stop", "matched": response.output_tokens[-1]}
    if response.stop_reason == "abort":
        message = "Aborted" if response.output_tokens else "Abort in waiting queue"
        return {"type": "abort", "message": message, "status_code": None, "err_type": None}
    return {"type": "length", "length": len(response.output_tokens)}


def generate_response(
    request: GenRequest, response: GenResponse, options: dict, *, version_name, decode
) -> dict[str, Any]:
    """A `GenResponse` -> SGLang's /generate reply for one prompt (meta_info keys in SGLang's order).

    ``weight_versions`` (SGLang >= 0.5.23) gives the version of each span of output tokens;
    ``version_name`` maps the engine's int versions to the server's weight_version strings.
    """
    sp = options["sampling_params"]
    skip_special = sp.get("skip_special_tokens", True)
    tokens = response.output_tokens
    trim = response.stop_reason == "stop" and not sp.get("no_stop_trim", False)
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(response.output_versions):
        if spans and spans[-1]["version"] == version_name(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version_name(v), "start": i, "end": i + 1})
    current = spans[-1]["version"] if spans else version_name(None)
    meta: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": finish_reason(response),
        "prompt_tokens": len(request.input_ids),
        "weight_version": current,
        "weight_versions": spans or [{"version": current, "start": 0, "end": 0}],
    }
    if options["return_logprob"]:
        with_text = options["return_text_in_logprobs"]
        meta["input_token_logprobs"] = [[None, request.input_ids[-1], None]]  # logprob_start_len -1: the last
        meta["output_token_logprobs"] = [
            [lp, tok, decode([tok], skip_special) if with_text else None]
            for lp, tok in zip(response.output_logprobs, tokens)
        ]
    meta.update(completion_tokens=len(tokens), cached_tokens=0, e2e_latency=response.latency)
    return {"text": decode(tokens[:-1] if trim else tokens, skip_special), "output_ids": tokens, "meta_info": meta}


def read_generate_response(reply: Any) -> GenerateReply:
    """SGLang's /generate reply -> `GenerateReply`.

    Tokens come from ``output_token_logprobs`` (SGLang 0.5.1-0.5.4 prefix ``output_ids`` with prompt
    tokens); an abort before prefill has no logprobs at all (0 tokens). Raises `ProtocolError` if the
    reply lacks what the client needs.
    """
    try:
        meta = reply["meta_info"]
        finish = meta["finish_reason"]
        kind = finish["type"] if isinstance(finish, dict) else "length"
        message = finish.get("message") or "" if isinstance(finish, dict) else ""
        if "output_token_logprobs" not in meta and kind == "abort":
            triples = []
        else:
            triples = meta["output_token_logprobs"]
        tokens = [int(t[1]) for t in triples]
        logprobs = [float(t[0]) if t[0] is not None else math.nan for t in triples]
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise ProtocolError(f"unexpected /generate reply (missing or bad {e}): {str(reply)[:300]}") from e
    versions: list[str | None] = [meta.get("weight_version")] * len(tokens)
    for span in meta.get("weight_versions") or []:
        for i in range(max(int(span["start"]), 0), min(int(span["end"]), len(tokens))):
            versions[i] = str(span["version"])
    return GenerateReply(str(meta.get("id", "")), tokens, logprobs, kind, versions, message)
