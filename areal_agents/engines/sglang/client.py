"""`SGLangEngine`: the `RemoteEngine` client for SGLang servers (or `serve-model`), interruptible.

    engine = SGLangEngine(["http://10.0.0.1:30000", "http://10.0.0.2:30000"], weights_dir="runs/x/weights")
    resp = await engine.agenerate(GenRequest("episode7/t0", prompt_ids, SamplingParams(max_new_tokens=256)))
    await engine.update_weights(policy.state_dict())   # pause all (abort), load from disk, continue

SGLang's native API: ``/generate`` with ``input_ids`` (token ids in, ``output_token_logprobs`` out),
``/pause_generation`` (``abort``; ``pause_mode="keep"`` sends ``in_place``) and ``/continue_generation``,
``/update_weights_from_disk``, ``/update_weight_version``, ``/abort_request``. Routing, retries,
resubmission and versions: `RemoteEngine`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from areal_agents.engines.remote_engine import GenerateReply, RemoteEngine
from areal_agents.engines.sglang.protocol import read_generate_response
from areal_agents.errors import EngineError
from areal_agents.types import GenRequest


class SGLangEngine(RemoteEngine):
    """An `InferenceEngine` over SGLang-native HTTP servers; see the module docstring."""

    GENERATE_PATH = "/generate"
    RID_KEY = "rid"

    def generate_body(self, request: GenRequest, tokens_so_far: list[int]) -> dict[str, Any]:
        sp = request.sampling
        return {
            "input_ids": request.input_ids + tokens_so_far,
            "sampling_params": {
                "max_new_tokens": sp.max_new_tokens - len(tokens_so_far),
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

    def read_reply(self, reply: Any) -> GenerateReply:
        return read_generate_response(reply)

    async def pause_servers(self) -> None:
        await self._all("/pause_generation", {"mode": "abort" if self.pause_mode == "abort" else "in_place"})

    async def resume_servers(self) -> None:
        await self._all("/continue_generation", {})

    async def load_on_servers(self, model_path: str, version: int) -> None:
        body = {
            "model_path": model_path,
            "weight_version": str(version),
            "abort_all_requests": self.pause_mode == "abort",
        }
        replies = await self._all("/update_weights_from_disk", body)
        failed = [(url, r) for url, r in zip(self.addresses, replies) if not r.get("success", False)]
        if failed:
            raise EngineError(f"update_weights_from_disk failed on {failed[0][0]}: {failed[0][1]}")

    async def name_version_on_servers(self, version: int) -> None:
        await self._all("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})

    async def abort_on_server(self, url: str, rid: str) -> None:
        await self._post_quick(url, "/abort_request", {"rid": rid})

    async def init_weights_update_group(
        self, master_address: str, master_port: int, *, tp_size: int = 1, group_name: str = "weight_update_group"
    ) -> int:
        """GPU path: every server's tp ranks join an NCCL group with the trainer as rank 0; returns its size.

        The trainer joins the same group concurrently, e.g. with SGLang's
        ``init_custom_process_group(backend="nccl", init_method=f"tcp://{addr}:{port}", world_size=size,
        rank=0, group_name=group_name)``. Written against SGLang 0.5.x; not runnable on a CPU-only machine.
        """
        world_size = 1 + len(self.addresses) * tp_size
        await asyncio.gather(
            *(
                self._post(
                    url,
                    "/init_weights_update_group",
                    {
                        "master_address": master_address,
                        "master_port": master_port,
                        "rank_offset": 1 + i * tp_size,
                        "world_size": world_size,
                        "group_name": group_name,
                        "backend": "nccl",
                    },
                )
                for i, url in enumerate(self.addresses)
            )
        )
        return world_size

    async def update_weights_from_distributed(
        self,
        named_tensors: list[tuple[str, Any]],
        broadcast,
        *,
        version: int | None = None,
        group_name: str = "weight_update_group",
    ) -> None:
        """GPU path: announce names/dtypes/shapes to every server, then ``broadcast(tensor)`` each from rank 0.

        ``broadcast`` is the trainer's ``torch.distributed.broadcast`` on the group made by
        `init_weights_update_group` (not runnable here: no NCCL).
        """

        async def load(version: int) -> None:
            body = {
                "names": [n for n, _ in named_tensors],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named_tensors],
                "shapes": [list(t.shape) for _, t in named_tensors],
                "group_name": group_name,
                "weight_version": str(version),
                "abort_all_requests": True,
            }
            posted = asyncio.ensure_future(self._all("/update_weights_from_distributed", body))
            for _, tensor in named_tensors:
                await asyncio.to_thread(broadcast, tensor)
            failed = [r for r in await posted if not r.get("success", False)]
            if failed:
                raise EngineError(f"update_weights_from_distributed failed: {failed[0]}")

        await self.swap_weights(load, version)
