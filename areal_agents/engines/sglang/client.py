"""`SGLangEngine`: the `RemoteEngine` client for SGLang servers (or `serve-model`), interruptible.

    engine = SGLangEngine(["http://10.0.0.1:30000", "http://10.0.0.2:30000"], weights_dir="runs/x/weights")
    resp = await engine.agenerate(GenRequest("episode7/t0", prompt_ids, SamplingParams(max_new_tokens=256)))
    await engine.update_weights(policy.state_dict())   # pause all (abort), load from disk, continue

SGLang's native API: ``/generate`` with ``input_ids`` (token ids in, ``output_token_logprobs`` out),
``/pause_generation`` (``abort``; ``pause_mode="keep"`` sends ``in_place``) and ``/continue_generation``,
``/update_weights_from_disk``, ``/update_weight_version``, ``/abort_request``; LoRA adapters (`LoraEngine`):
``/load_lora_adapter`` and ``/unload_lora_adapter``, a request naming its adapter as ``lora_path``, its own
sampler seed as ``sampling_params.sampling_seed``. Routing, retries,
resubmission and versions: `RemoteEngine`. The broadcast weight update (``/init_weights_update_group``,
``/update_weights_from_distributed``) is `BroadcastSync`'s, over this client.
"""

from __future__ import annotations

from typing import Any

from areal_agents.engines.remote_engine import GenerateReply, RemoteEngine
from areal_agents.engines.server_metrics import SGLANG_METRICS
from areal_agents.engines.sglang.protocol import read_generate_response
from areal_agents.errors import EngineError
from areal_agents.types import GenRequest


class SGLangEngine(RemoteEngine):
    """An `InferenceEngine` over SGLang-native HTTP servers; see the module docstring."""

    GENERATE_PATH = "/generate"
    RID_KEY = "rid"
    METRICS = SGLANG_METRICS

    def generate_body(self, request: GenRequest) -> dict[str, Any]:
        sp = request.sampling
        body: dict[str, Any] = {
            "input_ids": request.input_ids,
            "sampling_params": {
                "max_new_tokens": sp.max_new_tokens,
                "temperature": sp.temperature,
                "top_p": sp.top_p,
                "top_k": sp.top_k if sp.top_k > 0 else -1,
                "stop_token_ids": list(sp.stop_token_ids),
                "ignore_eos": sp.ignore_eos,
                "skip_special_tokens": False,
                "no_stop_trim": True,
            },
            "return_logprob": True,
        }
        if sp.seed is not None:
            body["sampling_params"]["sampling_seed"] = sp.seed
        if request.lora_name is not None:
            body["lora_path"] = request.lora_name  # SGLang names a loaded adapter by its lora_name here
        return body

    def read_reply(self, reply: Any) -> GenerateReply:
        return read_generate_response(reply)

    async def pause_servers(self) -> None:
        await self._all("/pause_generation", {"mode": "abort" if self.pausing == "abort" else "in_place"})

    async def resume_servers(self) -> None:
        await self._all("/continue_generation", {})

    async def load_on_servers(self, model_path: str, version: int) -> None:
        body = {
            "model_path": model_path,
            "weight_version": str(version),
            "abort_all_requests": self.pausing == "abort",
            "flush_cache": self.flush_with_update(),
        }
        replies = await self._all("/update_weights_from_disk", body)
        failed = [(url, r) for url, r in zip(self.addresses, replies) if not r.get("success", False)]
        if failed:
            raise EngineError(f"update_weights_from_disk failed on {failed[0][0]}: {failed[0][1]}")

    async def name_version_on_servers(self, version: int) -> None:
        await self._all("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})

    async def load_lora_on_servers(self, name: str, path: str, replace: bool) -> None:
        """``/load_lora_adapter`` on every (paused) server. SGLang refuses a name it serves, so a replacement
        unloads it first; the new load gets a new adapter id, which keys its radix cache (no stale KV)."""
        if replace:
            await self.unload_lora_on_servers(name)
        await self._all(self.LORA_LOAD_PATH, {"lora_name": name, "lora_path": path})

    async def unload_lora_on_servers(self, name: str) -> None:
        await self._all("/unload_lora_adapter", {"lora_name": name})

    async def abort_on_server(self, url: str, rid: str) -> None:
        await self._post_quick(url, "/abort_request", {"rid": rid})
