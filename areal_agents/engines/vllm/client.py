"""`VLLMEngine`: the `RemoteEngine` client for vLLM OpenAI-compatible servers (vLLM >= 0.32), interruptible.

    engine = VLLMEngine(["http://127.0.0.1:8000"], weights_dir="runs/x/engine_weights")
    resp = await engine.agenerate(GenRequest("episode7/t0", prompt_ids, SamplingParams(max_new_tokens=256)))
    await engine.update_weights(policy.state_dict())   # pause, reload_weights from disk, name the version

Routes (the server needs ``--enable-scale-out`` and ``VLLM_SERVER_DEV_MODE=1``; `vllm_command` sets both):
``/inference/v1/generate`` (token ids in, token ids with their logprobs and ``weight_versions`` spans out),
``/pause?mode=abort|keep`` and ``/resume``, ``/collective_rpc`` with ``reload_weights`` (the weight-sync seam's
disk transport), ``/update_weight_version``, ``/inference/v1/abort_requests``; LoRA adapters (`LoraEngine`;
the server runs with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, a request naming its adapter as ``model``, its own sampler ``seed``. Routing,
retries, resubmission and versions: `RemoteEngine`.

Logprobs: the server runs with ``--logprobs-mode processed_logprobs``, so a token's logprob is
``log softmax(logits / T)``, what `HFEngine` and the trainer compute, as long as top-k / top-p are off;
with them on, vLLM's are those of the truncated distribution it sampled from.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from areal_agents.engines.remote_engine import GenerateReply, RemoteEngine
from areal_agents.engines.server_metrics import VLLM_METRICS
from areal_agents.errors import EngineError, RequestError
from areal_agents.types import GenRequest

FINISH_REASONS = ("stop", "length", "abort")
REQUEST_ID_PREFIX = "generate-tokens-"  # what the token route puts before a request's id inside the server


class VLLMEngine(RemoteEngine):
    """An `InferenceEngine` over vLLM servers; see the module docstring."""

    GENERATE_PATH = "/inference/v1/generate"
    METRICS = VLLM_METRICS
    LORA_LOAD_PATH = "/v1/load_lora_adapter"
    RID_KEY = "request_id"

    def generate_body(self, request: GenRequest) -> dict[str, Any]:
        sp = request.sampling
        body: dict[str, Any] = {
            "token_ids": request.input_ids,
            "sampling_params": {
                "max_tokens": sp.max_new_tokens,
                "temperature": sp.temperature,
                "top_p": sp.top_p,
                "top_k": sp.top_k,
                "stop_token_ids": list(sp.stop_token_ids),
                "ignore_eos": sp.ignore_eos,
                "logprobs": 0,
                "skip_special_tokens": False,
                "detokenize": False,
            },
        }
        if sp.seed is not None:
            body["sampling_params"]["seed"] = sp.seed
        if request.lora_name is not None:
            body["model"] = request.lora_name  # a loaded adapter is served as a model of its name
        return body

    def read_reply(self, reply: Any) -> GenerateReply:
        return read_generate_reply(reply)

    async def pause_servers(self) -> None:
        await self._all("/pause", None, params={"mode": self.pausing})

    async def resume_servers(self) -> None:
        await self._all("/resume", None)

    async def load_on_servers(self, model_path: str, version: int) -> None:
        check_reloadable(Path(model_path))
        body = {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
        await self._all("/collective_rpc", body)
        if self.pausing == "abort":  # nothing runs: no KV of the old weights may be found again
            replies = await self._all("/reset_prefix_cache", None)
            if not all(r.get("success") for r in replies):
                raise EngineError(f"reset_prefix_cache after reload_weights failed: {replies}")
        await self.name_version_on_servers(version)

    async def name_version_on_servers(self, version: int) -> None:
        await self._all("/update_weight_version", {"new_version": str(version)})

    async def load_lora_on_servers(self, name: str, path: str, replace: bool) -> None:
        """``/v1/load_lora_adapter`` on every (paused) server; a replacement unloads the name and loads it
        afresh (a new adapter id) with nothing running (`lora_pause_mode`: abort), then resets the prefix
        cache, which vLLM keys by adapter name and path, not weights. Never ``load_inplace``: vLLM 0.32 keeps
        such an adapter's request entry and re-reads its directory at every step a request carries it (the
        server died when that directory was gone, measured), and a request kept through the pause would hold
        an adapter id that can be evicted and reloaded from its old path."""
        if not replace:
            try:
                await self._all(self.LORA_LOAD_PATH, _lora_body(name, path), text=True)
                return
            except RequestError as e:  # loaded there before (another client, an earlier run): replace it
                if "already been loaded" not in str(e):
                    raise
        await self.unload_lora_on_servers(name)
        await self._all(self.LORA_LOAD_PATH, _lora_body(name, path), text=True)
        if self.pausing != "abort":  # a name another client loaded, replaced under a keep pause: the cache is in use
            return
        replies = await self._all("/reset_prefix_cache", None)
        if not all(r.get("success") for r in replies):
            raise EngineError(f"reset_prefix_cache after load_lora_adapter failed: {replies}")

    async def unload_lora_on_servers(self, name: str) -> None:
        await self._all("/v1/unload_lora_adapter", {"lora_name": name}, text=True)

    async def abort_on_server(self, url: str, rid: str) -> None:
        await self._post_quick(url, "/inference/v1/abort_requests", {"request_ids": [REQUEST_ID_PREFIX + rid]})


def _lora_body(name: str, path: str) -> dict[str, Any]:
    return {"lora_name": name, "lora_path": path, "load_inplace": False}


def check_reloadable(path: Path) -> None:
    """Refuse weights vLLM's ``reload_weights`` would load wrongly, before a server sees them: a directory
    without ``*.safetensors`` (vLLM looks the path up on the Hub instead and fails), and a checkpoint that ties
    ``lm_head`` to the embeddings and leaves it out, as transformers' ``save_pretrained`` does: the reload
    then keeps the old ``lm_head`` beside the new embeddings. `write_weights` stores ``lm_head``."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EngineError(f"reload_weights: {path} holds no *.safetensors files")
    names = {name for f in files for name in safetensors_names(f)}
    if "lm_head.weight" not in names and any(n.endswith("embed_tokens.weight") for n in names):
        raise EngineError(
            f"reload_weights: {path} has no lm_head.weight (tied to the embeddings and left out, as "
            "save_pretrained does); vLLM would keep the old lm_head. Write the weights with "
            "areal_agents.models.weight_files.write_weights, which stores it."
        )


def safetensors_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file's header (the tensors are not read)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return [name for name in header if name != "__metadata__"]


def read_generate_reply(reply: Any) -> GenerateReply:
    """vLLM's ``/inference/v1/generate`` reply (``output_mode="tokens"``, one choice) -> `GenerateReply`.
    Raises `ValueError` naming what is missing; a choice that finished with ``error`` is an `EngineError`."""
    try:
        choice = reply["choices"][0]
        finish = choice["finish_reason"]
        tokens = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(c["logprob"]) if c.get("logprob") is not None else math.nan for c in content]
        spans = choice.get("weight_versions") or []
        versions: list[str | None] = [None] * len(tokens)
        for span in spans:
            for i in range(max(int(span["start"]), 0), min(int(span["end"]), len(tokens))):
                versions[i] = str(span["version"])
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise ValueError(f"unexpected reply (missing or bad {e}): {str(reply)[:300]}") from e
    if finish not in FINISH_REASONS:
        raise EngineError(f"generation ended with finish_reason {finish!r}: {str(reply)[:300]}")
    if len(logprobs) != len(tokens):
        raise ValueError(f"{len(tokens)} token_ids but {len(logprobs)} logprobs: {str(reply)[:300]}")
    if tokens and None in versions:  # never tag a token with a version the server did not report
        covered = len(tokens) - versions.count(None)
        raise ValueError(
            f"weight_versions covers {covered} of {len(tokens)} tokens (vLLM >= 0.32 reports every token's): "
            f"{str(reply)[:300]}"
        )
    return GenerateReply(str(reply.get("request_id", "")), tokens, logprobs, finish, versions)
